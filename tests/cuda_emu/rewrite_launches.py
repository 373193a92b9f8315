#!/usr/bin/env python3
"""Rewrite the CUDA launches of a .cu file into host C++ for the CUDA emulation.

    python3 tests/cuda_emu/rewrite_launches.py IN.cu OUT.cpp

Every ``name<targs><<<config>>>(args);`` becomes
``{ auto ct_emu_k_ = ct_emu_bind([](auto... a) { name<targs>(a...); }, args);
ct_emu_launch(ct_emu_k_, config); }``: the arguments are evaluated at the launch
(see tests/cuda_emu/cuda_runtime.h). The output keeps the input's line numbers
(``#line`` and padded newlines), so diagnostics and ``__FILE__`` name the .cu
source. Anything between ``<<<`` and ``;`` that is not a launch is an error.
"""
import sys

IDENT = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_:")


def _match(s, i, open_ch, close_ch, step):
    """Index of the bracket matching s[i], scanning forwards (step 1, s[i] == open_ch) or
    backwards (step -1, s[i] == close_ch)."""
    depth = 0
    first, last = (open_ch, close_ch) if step == 1 else (close_ch, open_ch)
    while 0 <= i < len(s):
        if s[i] == first:
            depth += 1
        elif s[i] == last:
            depth -= 1
            if depth == 0:
                return i
        i += step
    raise ValueError(f"unbalanced {first!r}")


def rewrite(src, path):
    out, pos, count = [], 0, 0
    while True:
        k = src.find("<<<", pos)
        if k < 0:
            break
        line = src.count("\n", 0, k) + 1
        # the kernel expression before <<<: identifier, optionally with template arguments
        j = k - 1
        while j >= 0 and src[j].isspace():
            j -= 1
        if src[j] == ">":
            j = _match(src, j, "<", ">", -1) - 1
        start = j
        while start >= 0 and src[start] in IDENT:
            start -= 1
        start += 1
        name = src[start:k].strip()
        if not name or not (name[0].isalpha() or name[0] == "_"):
            raise SystemExit(f"{path}:{line}: cannot find the kernel before <<<")
        e = src.find(">>>", k)
        if e < 0:
            raise SystemExit(f"{path}:{line}: <<< without >>>")
        config = src[k + 3:e].strip()
        a = e + 3
        while src[a].isspace():
            a += 1
        if src[a] != "(":
            raise SystemExit(f"{path}:{line}: expected ( after >>>")
        b = _match(src, a, "(", ")", 1)
        c = b + 1
        while src[c].isspace():
            c += 1
        if src[c] != ";":
            raise SystemExit(f"{path}:{line}: expected ; after the launch arguments")
        args = src[a + 1:b]
        span = src[start:c + 1]
        out.append(src[pos:start])
        args = " ".join(args.split())
        out.append("{ auto ct_emu_k_ = ct_emu_bind([](auto... ct_emu_a_) { %s(ct_emu_a_...); }%s); "
                   "ct_emu_launch(ct_emu_k_, %s); }"
                   % (name, ", " + args if args else "", " ".join(config.split())))
        out.append("\n" * span.count("\n"))
        pos = c + 1
        count += 1
    out.append(src[pos:])
    return f'#line 1 "{path}"\n' + "".join(out), count


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    src_path, dst_path = sys.argv[1], sys.argv[2]
    with open(src_path) as f:
        text, n = rewrite(f.read(), src_path)
    if n == 0 and "<<<" in text:
        raise SystemExit(f"{src_path}: launches left unrewritten")
    with open(dst_path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
