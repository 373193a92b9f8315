#!/usr/bin/env python3
"""Rewrite the CUDA launches of a .cu file into host C++ for the CUDA emulation.

    python3 tests/cuda_emu/rewrite_launches.py IN.cu OUT.cpp

Every ``name<targs><<<config>>>(args);`` becomes
``{ auto ct_emu_k_ = ct_emu_bind([](auto... a) { name<targs>(a...); }, args);
ct_emu_launch_fibers(ct_emu_k_, config); }``: the arguments are evaluated at the launch
(see tests/cuda_emu/cuda_runtime.h). ``_fibers`` where the kernel may reach
``__syncthreads`` (its body or a function it calls, transitively, within the file),
``ct_emu_launch_plain`` (threads run one after another) otherwise. The output keeps the input's line numbers
(``#line`` and padded newlines), so diagnostics and ``__FILE__`` name the .cu
source. Anything between ``<<<`` and ``;`` that is not a launch is an error.
"""
import re
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


_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "defined", "__launch_bounds__",
             "__attribute__", "static_cast", "reinterpret_cast", "const_cast", "decltype"}


def barrier_functions(src):
    """Names of the functions defined in src that may reach __syncthreads: those whose body
    calls it, then those that call one of them (to a fixed point). Definitions are found at
    brace depth 0 (after namespaces/extern blocks are looked into) by the identifier before
    the first parenthesis of the text that precedes a body."""
    # comments, strings and preprocessor lines out: they hold parentheses and braces
    src = re.sub(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'", " ", src,
                 flags=re.S)
    src = re.sub(r"^\s*#[^\n]*(?:\\\n[^\n]*)*", " ", src, flags=re.M)
    bodies = {}
    depth, last, i = 0, 0, 0
    opened = []  # (start of header, depth) of the blocks being scanned for definitions
    while i < len(src):
        ch = src[i]
        if ch == "{":
            header = src[last:i]
            hdr = re.sub(r"__launch_bounds__\s*\([^)]*\)|__attribute__\s*\(\(.*?\)\)", " ", header)
            names = [m.group(1) for m in re.finditer(r"([A-Za-z_]\w*)\s*\(", hdr)
                     if m.group(1) not in _KEYWORDS]
            # a type's header names struct/class/...; a template's parameter list may too
            # (`template <class T>`), so that list is left out of the test
            decl = re.sub(r"\btemplate\s*<[^;{}()]*>", " ", hdr.split("(")[0])
            if names and ")" in hdr and not re.search(r"\b(struct|class|union|enum|namespace)\b", decl):
                end = _match(src, i, "{", "}", 1)
                bodies.setdefault(names[0], []).append(src[i:end + 1])
                i = end + 1
                last = i
                continue
            depth += 1  # a namespace, extern "C" or type: look inside
            last = i + 1
        elif ch == "}":
            depth -= 1
            last = i + 1
        elif ch == ";":
            last = i + 1
        i += 1
    calls = {n: set(re.findall(r"([A-Za-z_]\w*)\s*(?:<[^<>;{}()]*>)?\s*\(", "".join(b)))
             for n, b in bodies.items()}
    found = {n for n, b in bodies.items() if "__syncthreads" in "".join(b)}
    while True:
        more = {n for n, c in calls.items() if n not in found and c & found}
        if not more:
            return found
        found |= more


def rewrite(src, path):
    barriers = barrier_functions(src)
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
        base = name.split("<")[0].strip().split("::")[-1]
        # threads as fibers where the kernel may reach __syncthreads; one after another otherwise
        launcher = "ct_emu_launch_fibers" if base in barriers else "ct_emu_launch_plain"
        out.append("{ auto ct_emu_k_ = ct_emu_bind([](auto... ct_emu_a_) { %s(ct_emu_a_...); }%s); "
                   "%s(ct_emu_k_, %s); }"
                   % (name, ", " + args if args else "", launcher, " ".join(config.split())))
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
