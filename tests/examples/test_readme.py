"""Every code block of README.md is checked: Python blocks run as written, with the values and
outputs they state; shell blocks name commands that exist.

Python blocks (```python). The blocks of one `##` section run in order in one fresh
interpreter (8 CPU devices), as a reader would paste them. A line whose comment states a value
is checked against it:

- `print(x)  # text`: what is printed must be `text`;
- a bare expression `expr  # value`, where `value` is a Python expression (evaluated in the
  block's namespace): `expr == value` must hold. Comments that are prose (they do not evaluate)
  or elide part of a value with `...` are not checked.

HTML comments just before a fence (blank lines between allowed) change that:

- `<!-- test: output -->` before a ```text block: the text is what the Python block before it
  printed, exactly;
- `<!-- test: pytest -->`: the block is a user's test module; it runs under pytest with
  ctrainstate's plugin and all its tests must pass;
- `<!-- snippet: NAME -->`: a porting recipe; tests/examples/test_porting.py runs it (checked here: it
  must execute NAME), the Flax originals only where jax and flax are installed;
- `<!-- test: skip REASON -->`: not run (it needs t5x, or it is a fragment of another
  project's script); reported as a skipped test with REASON.

Shell blocks (```bash): each command must exist: the scripts and test paths it names, the pip
extras it installs, the Makefile targets it makes, and executables on PATH. ```text blocks are
not code (file layouts, outputs). Any other fence is an error.
"""
import ast
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
LANGS = ("python", "bash", "text")


class Block:
    def __init__(self, section, lang, code, markers, line):
        self.section, self.lang, self.code, self.line = section, lang, code, line
        self.markers = markers            # the HTML comments just before the fence

    def marker(self, kind):
        """The argument of `<!-- KIND ... -->` (KIND like 'test: skip'), or None."""
        for m in self.markers:
            if m == kind or m.startswith(kind + " "):
                return m[len(kind):].strip()
        return None


def parse(text):
    """Every fenced block of a markdown text, with its `##` section and markers."""
    blocks, section, pending = [], None, []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("## "):
            section, pending = ln[3:], []
        elif ln.startswith("```"):
            lang = ln[3:].strip()
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            if j == len(lines):
                raise ValueError(f"README.md:{i + 1}: unterminated fence")
            blocks.append(Block(section, lang, "\n".join(lines[i + 1:j]) + "\n", pending, i + 1))
            pending, i = [], j
        else:
            m = re.fullmatch(r"<!--\s*(.*?)\s*-->", ln.strip())
            if m:
                pending.append(m.group(1))
            elif ln.strip():
                pending = []
        i += 1
    return blocks


BLOCKS = parse(open(README).read())


# --- Python blocks: the per-section programs ---------------------------------------------


def comments_by_line(code):
    """{line number: comment text} for lines with a trailing comment."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string[1:].strip()
    return out


class _Instrument(ast.NodeTransformer):
    """Wrap each expression statement with a stated value in a call that checks it."""

    def __init__(self, comments):
        self.comments = comments
        self.checked = 0

    def visit_Expr(self, node):
        comment = self.comments.get(node.end_lineno)
        if comment is None or "..." in comment:
            return node
        call = node.value
        is_print = (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id == "print" and len(call.args) == 1 and not call.keywords)
        fn = "_readme_check_print" if is_print else "_readme_check_value"
        arg = call.args[0] if is_print else call
        self.checked += 1
        new = ast.Expr(ast.Call(ast.Name(fn, ast.Load()),
                                [arg, ast.Constant(comment), ast.Constant(node.lineno)], []))
        return ast.copy_location(new, node)


CHECKS = '''
def _readme_check_print(value, comment, line):
    print(value)
    assert str(value) == comment, f"block line {line}: printed {value!s}, the README says {comment}"

def _readme_check_value(value, comment, line):
    try:
        want = eval(comment, globals())
    except Exception:  # prose, not a value
        return
    assert value == want, f"block line {line}: got {value!r}, the README says {comment}"
'''
DELIM = "\x1e README block {} \x1e"


def program(codes):
    """The blocks as one script with the stated values checked, each block's output preceded
    by a delimiter line; and how many values it checks."""
    parts, checked = [CHECKS], 0
    for i, code in enumerate(codes):
        tree = ast.parse(code)
        inst = _Instrument(comments_by_line(code))
        tree = ast.fix_missing_locations(inst.visit(tree))
        checked += inst.checked
        parts.append(f"# --- block {i}\nprint({DELIM.format(i)!r}, flush=True)\n"
                     + ast.unparse(tree))
    return "\n".join(parts), checked


def split_output(stdout, n):
    """Each block's printed output, by the delimiters `program` prints."""
    out = []
    for i in range(n):
        start = stdout.index(DELIM.format(i) + "\n") + len(DELIM.format(i)) + 1
        end = stdout.find(DELIM.format(i + 1)) if i + 1 < n else len(stdout)
        out.append(stdout[start:end])
    return out


def plain(b):
    """A Python block run by this file's section programs."""
    return b.lang == "python" and not any(
        b.marker(k) is not None for k in ("test: skip", "test: pytest", "snippet:"))


def section_programs(blocks):
    """{section: ([plain python blocks], {index among them: expected output text})}."""
    out = {}
    for k, b in enumerate(blocks):
        if plain(b):
            out.setdefault(b.section, ([], {}))[0].append(b)
        elif b.lang == "text" and b.marker("test: output") is not None:
            prev = blocks[k - 1] if k else None
            if prev is None or not plain(prev) or prev.section != b.section:
                raise ValueError(f"README.md:{b.line}: an output block must follow a Python "
                                 f"block of its section that this file runs")
            codes, expected = out[b.section]
            expected[len(codes) - 1] = b.code
    return out


SECTIONS = section_programs(BLOCKS)


def run_python(code, timeout=300):
    env = dict(os.environ)
    env["CTRAINSTATE_NUM_CPU_DEVICES"] = "8"
    if env.get("CTRAINSTATE_SANITIZED") != "1":
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(ROOT, "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


def check_section(blocks, expected):
    code, _ = program([b.code for b in blocks])
    r = run_python(code)
    assert r.returncode == 0, f"README section {blocks[0].section!r}:\n{r.stdout}\n{r.stderr}"
    outs = split_output(r.stdout, len(blocks))
    for i, want in expected.items():
        assert outs[i] == want, (f"README.md:{blocks[i].line}: the block printed\n{outs[i]}"
                                 f"the README shows\n{want}")


@pytest.mark.parametrize("head", list(SECTIONS))
def test_readme_section_runs(head):
    blocks, expected = SECTIONS[head]
    check_section(blocks, expected)


def test_the_readme_has_the_sections_and_blocks_checked_here():
    assert {"The use case", "Devices and configuration", "Meshes and shardings",
            "Training: optimizers and TrainState", "Checkpoints",
            "Multiple processes"} <= set(SECTIONS)
    # the instrumentation sees the stated values (a checker that checked nothing would pass)
    total = sum(program([b.code for b in bl])[1] for bl, _ in SECTIONS.values())
    assert total >= 10, total
    assert sum(len(e) for _, e in SECTIONS.values()) >= 1      # an output block is checked
    assert sum(b.marker("test: pytest") is not None for b in BLOCKS) >= 1


def test_every_fence_is_python_bash_or_text():
    bad = [(b.line, b.lang) for b in BLOCKS if b.lang not in LANGS]
    assert not bad, f"README.md fences with another or no language (line, language): {bad}"


def test_a_wrong_stated_value_fails():
    """The checks can fail: a block whose comment states a wrong value is caught."""
    code, checked = program(["x = 2 + 2\nx  # 5\n"])
    assert checked == 1
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "the README says 5" in r.stderr


def test_a_wrong_output_block_fails():
    text = ("## S\n\n```python\nprint('a')\n```\n\n```python\nprint('b')\n```\n\n"
            "<!-- test: output -->\n```text\nc\n```\n")
    blocks, expected = section_programs(parse(text))["S"]
    assert expected == {1: "c\n"}
    with pytest.raises(AssertionError, match=r"the block printed\s+b\s+the README shows\s+c"):
        check_section(blocks, expected)
    check_section(blocks, {0: "a\n", 1: "b\n"})
    with pytest.raises(ValueError, match="must follow a Python block"):
        section_programs(parse("## S\n\n<!-- test: output -->\n```text\nc\n```\n"))


# --- Python blocks run elsewhere or not at all --------------------------------------------


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.marker("test: pytest") is not None],
                         ids=lambda b: f"line{b.line}")
def test_pytest_block_passes(block, tmp_path):
    (tmp_path / "test_readme_block.py").write_text(block.code)
    env = dict(os.environ)
    env.pop("CTRAINSTATE_NUM_CPU_DEVICES", None)   # the plugin, not the environment, decides
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.join(ROOT, "python"), env.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                        "ctrainstate_pytest", str(tmp_path)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    n = len(re.findall(r"^def test_", block.code, re.M))
    assert n and r.returncode == 0 and f"{n} passed" in r.stdout, r.stdout[-3000:] + r.stderr


def porting_executes():
    """The snippet names tests/examples/test_porting.py executes."""
    src = open(os.path.join(ROOT, "tests", "examples", "test_porting.py")).read()
    names = set(re.findall(r'exec\(compile\(s\["([^"]+)"\]', src))
    for args in re.findall(r"run_ct\(([^)]*)\)", src):
        names |= set(re.findall(r'"([^"]+)"', args))
    return names


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.marker("snippet:") is not None
                                   and b.marker("test: skip") is None],
                         ids=lambda b: b.marker("snippet:"))
def test_snippet_is_run_by_test_porting(block):
    assert block.lang == "python"
    assert block.marker("snippet:") in porting_executes()


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.marker("test: skip") is not None],
                         ids=lambda b: f"line{b.line}")
def test_not_run(block):
    reason = block.marker("test: skip")
    assert len(reason) > 10, f"README.md:{block.line}: say why the block is not run"
    pytest.skip(f"README.md:{block.line}: {reason}")


# --- shell blocks --------------------------------------------------------------------------


def extras():
    try:
        import tomllib
    except ImportError:                                    # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return set(tomllib.load(f)["project"]["optional-dependencies"])


def make_targets(directory):
    path = os.path.join(ROOT, directory, "Makefile")
    if not os.path.exists(path):
        return None
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:", open(path).read(), re.M))


def command_problems(line):
    """Why a shell line's commands would not run from the repository's root ([] if none)."""
    problems = []
    words = shlex.split(line, comments=True)
    commands, cur = [], []
    for w in words:
        if w in ("&&", "||", ";", "|"):
            commands.append(cur)
            cur = []
        else:
            cur.append(w)
    commands.append(cur)
    for cmd in filter(None, commands):
        while cmd and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", cmd[0]):
            cmd = cmd[1:]                                  # VAR=value before the command
        if not cmd:
            continue
        exe, args = cmd[0], cmd[1:]
        if exe in ("python", "python3"):
            if args[:2] == ["-m", "pip"]:
                exe, args = "pip", args[2:]
            elif args[:1] == ["-m"]:
                import importlib.util
                if importlib.util.find_spec(args[1]) is None:
                    problems.append(f"no module {args[1]}")
                paths = [a for a in args[2:] if not a.startswith("-") and "/" in a]
                problems += [f"no {p}" for p in paths if not os.path.exists(os.path.join(ROOT, p))]
                continue
            else:
                script = next((a for a in args if not a.startswith("-")), None)
                if script is None or not os.path.isfile(os.path.join(ROOT, script)):
                    problems.append(f"no script {script}")
                continue
        if exe == "pip":
            if args[:1] != ["install"]:
                problems.append(f"pip {args[:1]}")
            for a in args[1:]:
                m = re.fullmatch(r"\.\[([^\]]*)\]", a)
                if m:
                    missing = set(m.group(1).split(",")) - extras()
                    problems += [f"no pip extra {e!r} in pyproject.toml" for e in sorted(missing)]
            continue
        if exe == "bash":
            if not os.path.isfile(os.path.join(ROOT, args[0])):
                problems.append(f"no script {args[0]}")
            continue
        if exe == "make":
            d = args[args.index("-C") + 1] if "-C" in args else "."
            targets = make_targets(d)
            wanted = [a for a in args if not a.startswith("-") and a != d]
            if targets is None:
                problems.append(f"no {d}/Makefile")
            else:
                problems += [f"no target {t} in {d}/Makefile" for t in wanted if t not in targets]
            continue
        if shutil.which(exe) is None:
            problems.append(f"no command {exe}")
    return problems


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "bash"],
                         ids=lambda b: f"line{b.line}")
def test_shell_commands_exist(block):
    for ln in block.code.splitlines():
        if ln.strip() and not ln.lstrip().startswith("#"):
            assert command_problems(ln) == [], f"README.md:{block.line}: {ln}"


def test_shell_check_can_fail():
    assert command_problems("pip install -e '.[test,nosuchextra]'") == [
        "no pip extra 'nosuchextra' in pyproject.toml"]
    assert command_problems("python examples/nosuch.py && bash tools/nosuch.sh") == [
        "no script examples/nosuch.py", "no script tools/nosuch.sh"]
    assert command_problems("make -C tests/c nosuchtarget") == [
        "no target nosuchtarget in tests/c/Makefile"]
    assert command_problems("python -m pytest -q tests/test_nosuch.py") == [
        "no tests/test_nosuch.py"]
    assert command_problems("CTRAINSTATE_X=1 nosuchcommand-xyz --flag  # a comment") == [
        "no command nosuchcommand-xyz"]
    assert command_problems("pip install -e '.[test,examples]' && python examples/siren.py") == []


# --- links ---------------------------------------------------------------------------------


def github_anchor(heading):
    """The anchor GitHub gives a heading: lowercase, punctuation dropped, spaces as '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_links_within_the_readme_reach_a_heading():
    text = open(README).read()
    anchors = {github_anchor(h) for h in re.findall(r"^#{1,6} (.*)$", text, re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert len(links) >= 15, links                   # the table of contents at least
    assert sorted(set(links) - anchors) == []
    for path in re.findall(r"\]\((?!#|https?:)([^)]+)\)", text):
        assert os.path.exists(os.path.join(ROOT, path)), path
