#!/usr/bin/env bash
# Screenshots of the executed notebooks, to look at what a reader sees: each notebook in
# examples/notebooks/ is executed headless (nbconvert's --execute, with nbclient), converted to
# HTML, and photographed by headless Chromium; the full-page PNG is also cut into tiles of
# TILE_H pixels that an image viewer shows at a readable size.
#
#   bash tools/notebook_screenshots.sh [OUTDIR]      # default /tmp/ctrainstate-notebooks
#
# Needs the notebooks extra and nbconvert (pip install -e '.[notebooks]' nbconvert) and Debian's
# chromium (apt-get install chromium). Writes OUTDIR/NAME.html, OUTDIR/NAME.png and
# OUTDIR/NAME.part-K.png; nothing in the repository changes (the notebooks stay clean).
# Environment: PYTHON (default python), WIDTH (default 1200), HEIGHT (the window's, default
# 12000), TILE_H (default 1500).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/ctrainstate-notebooks}
py=${PYTHON:-python}
width=${WIDTH:-1200}
tile=${TILE_H:-1500}
height=${HEIGHT:-12000}   # the window: taller than the pages; the blank below is cropped
mkdir -p "$out"
out=$(cd "$out" && pwd)
command -v chromium >/dev/null || { echo "needs chromium: apt-get install chromium" >&2; exit 1; }
"$py" -c 'import nbconvert, nbclient, ipykernel' 2>/dev/null ||
    { echo "needs: pip install -e '.[notebooks]' nbconvert" >&2; exit 1; }
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
unset MPLBACKEND
for nb in examples/notebooks/*.ipynb; do
    name=$(basename "$nb" .ipynb)
    start=$SECONDS
    # executed in the notebook's folder, as Jupyter runs it; the output goes to OUTDIR only
    "$py" -m nbconvert --to html --execute --ExecutePreprocessor.timeout=300 \
        --output-dir "$out" --output "$name" "$nb" 2>"$out/$name.log"
    echo "$name: executed and converted in $((SECONDS - start)) s -> $out/$name.html"
    chromium --headless --no-sandbox --disable-gpu --hide-scrollbars \
        --window-size="$width,$height" --screenshot="$out/$name.png" \
        "file://$out/$name.html" >/dev/null 2>>"$out/$name.log"
    "$py" - "$out/$name.png" "$tile" <<'EOF'
import sys
from PIL import Image
path, tile = sys.argv[1], int(sys.argv[2])
im = Image.open(path)
# drop the blank page below the content
bbox = Image.eval(im.convert("L"), lambda v: 255 - v).getbbox()
if bbox:
    if bbox[3] >= im.height - 1:
        print(f"{path}: the page is taller than the window; raise HEIGHT", file=sys.stderr)
    im = im.crop((0, 0, im.width, min(im.height, bbox[3] + 20)))
    im.save(path)
for k, top in enumerate(range(0, im.height, tile)):
    im.crop((0, top, im.width, min(im.height, top + tile))).save(
        path.replace(".png", f".part-{k + 1}.png"))
print(f"{path}: {im.width}x{im.height}, {(im.height + tile - 1) // tile} tiles")
EOF
done
