"""README.md's Python examples run as written, and the values their comments state are the values.

Every ```python block of the README's sections before "Porting from Flax, t5x and HuggingFace"
(the porting recipes are tests/test_porting.py's) runs in a fresh interpreter, the blocks of one
`##` section in order in one namespace, as a reader would paste them. A line whose comment
states a value is checked against it:

- `print(x)  # text`: what is printed must be `text`;
- a bare expression `expr  # value`, where `value` is a Python expression (evaluated in the
  block's namespace): `expr == value` must hold. Comments that are prose (they do not evaluate)
  or elide part of a value with `...` are not checked.
"""
import ast
import io
import os
import re
import subprocess
import sys
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def sections():
    """{section heading: [python block, ...]} for the `##` sections before the porting part."""
    text = open(README).read().split("\n## Porting from Flax")[0]
    out, head = {}, None
    for m in re.finditer(r"^(## [^\n]*)$|^```python\n(.*?)^```", text, re.S | re.M):
        if m.group(1):
            head = m.group(1)[3:]
        elif head is not None:
            out.setdefault(head, []).append(m.group(2))
    return out


SECTIONS = sections()


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


def program(blocks):
    """The section's blocks as one script with the stated values checked; and how many."""
    parts, checked = [CHECKS], 0
    for i, code in enumerate(blocks):
        tree = ast.parse(code)
        inst = _Instrument(comments_by_line(code))
        tree = ast.fix_missing_locations(inst.visit(tree))
        checked += inst.checked
        parts.append(f"# --- block {i}\n" + ast.unparse(tree))
    return "\n".join(parts), checked


def test_the_readme_has_the_sections_checked_here():
    assert {"Devices", "Sharded arrays", "Optimizers and TrainState (`ctrainstate.optim`, "
            "`ctrainstate.train_state`)"} <= set(SECTIONS)
    # the instrumentation sees the stated values (a checker that checked nothing would pass)
    total = sum(program(b)[1] for b in SECTIONS.values())
    assert total >= 5, total


def test_a_wrong_stated_value_fails():
    """The checks can fail: a block whose comment states a wrong value is caught."""
    code, checked = program(["x = 2 + 2\nx  # 5\n"])
    assert checked == 1
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "the README says 5" in r.stderr


@pytest.mark.parametrize("head", list(SECTIONS))
def test_readme_section_runs(head):
    code, _ = program(SECTIONS[head])
    env = dict(os.environ)
    env["CTRAINSTATE_NUM_CPU_DEVICES"] = "8"
    if env.get("CTRAINSTATE_SANITIZED") != "1":
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(ROOT, "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, f"README section {head!r}:\n{r.stdout}\n{r.stderr}"
