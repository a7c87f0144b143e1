"""Rewrap the lines of Python files that are longer than the line limit, in the house style.

    python scripts/wrap_long_lines.py [--max-length 100] [--dry-run] FILE...

Only over-long lines change (and, for comments and docstrings, the rest of their paragraph);
nothing else in a file is touched, so it is not a formatter. One fix at a time, top to bottom:

- a comment line is rewrapped at spaces, keeping its indentation and `#` prefix (a bullet's
  continuation hangs under its text); the words that overflow join the next line of the same
  paragraph, or a new line. A `# ---- title ----` rule is cut to the limit.
- a docstring line is rewrapped the same way; in a table (columns apart by 2+ spaces) only the
  last cell, under itself. A line with a bar or a `>>>` prompt, or an indented line that is not
  a bullet's or a cell's continuation (a code block), is left alone.
- a trailing comment that makes a line long moves to its own line above the code.
- a one-line simple statement (assignment, return, assert, if/while test) whose expression is an
  operation or a tuple gets its expression parenthesised, then breaks at its loosest operator.
- code breaks at a comma or before an operator (`and`, `or`, a comprehension's `for`/`if`, a
  binary operator) inside an open bracket, the continuation aligned under the bracket's first
  token. Preferred: a list over a subscript, the bracket that holds the overflow, the outermost
  one, a comma over an operator, the loosest operator, the rightmost place that fits. A short
  remainder joins the next line when that continues the same bracket at the same column.
- failing that, a string literal is split after a space into an implicit concatenation (inside
  parentheses when it is in none), never inside an f-string's braces.
- failing that, a `def` signature hangs: its parameters on the next line, indented by 8.

Every fix is checked before it is kept: the file must parse to the same AST as before
(`ast.dump`, with docstrings compared with their whitespace collapsed) and keep the same comment
words in the same order. A line the tool cannot fix that way is left as it was and reported
(`path:line: reason`) for a hand fix. Exit status 1 when some line is left too long.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
import unicodedata
from dataclasses import dataclass
from pathlib import Path

OPEN = {"(": ")", "[": "]", "{": "}"}
CLOSE = set(OPEN.values())
# break before these inside a bracket (a binary or boolean operator, a comprehension's clause)
BREAK_BEFORE_WORDS = ("and", "or", "if", "else", "for")
BREAK_BEFORE_OPS = ("+", "-", "*", "/", "//", "%", "@", "|", "&", "==", "!=", "<=", ">=", "<", ">")
PRAGMA = re.compile(r"#\s*(type:|noqa|pragma|fmt:|pyright:|mypy:|ruff:)")
BULLET = re.compile(r"(-|\*|\d+[.)]) ")
RULE = re.compile(r"^(?P<head>#\s*-{2,}\s.*?\s)-{2,}\s*$")
STRING_PREFIX = re.compile(r"^([rRbBuUfF]{0,2})('''|\"\"\"|'|\")")
KEYWORDS = {"and", "or", "not", "in", "is", "if", "else", "for", "lambda", "return", "yield",
            "await", "assert", "del", "raise", "from", "import", "with", "as", "while", "elif"}
# lower binds looser: a break goes before the loosest operator first
PRECEDENCE = {"if": 0, "else": 0, "for": 0, "or": 1, "and": 2, "==": 4, "!=": 4, "<": 4, ">": 4,
              "<=": 4, ">=": 4, "|": 5, "&": 6, "+": 7, "-": 7, "*": 8, "/": 8, "//": 8, "%": 8,
              "@": 8}
SKIP_TOKENS = {tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT,
               tokenize.ENDMARKER}


class Refused(Exception):
    """The line cannot be fixed safely by the tool; the message says why."""


@dataclass
class Bracket:
    char: str
    line: int  # 1-based
    col: int
    align: int = -1  # column of the first token after the bracket (on whatever line)
    depth: int = 0  # number of brackets open outside this one
    is_subscript: bool = False  # `x[...]` (a type's parameters, an index), not a list
    end_line: int = 0  # the line of the closing bracket
    end_col: int = 0  # and its column


@dataclass
class Tok:
    type: int
    string: str
    line: int
    col: int
    end_line: int
    end_col: int
    open: tuple[Bracket, ...]  # brackets open at this token, outermost first (not counting itself)


class Source:
    """One tokenized state of a file: its lines, tokens with their bracket context, docstring
    spans."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = text.splitlines(keepends=True)
        self.tree = ast.parse(text)
        raw = list(tokenize.generate_tokens(io.StringIO(text).readline))
        self.toks: list[Tok] = []
        stack: list[Bracket] = []
        self.brackets: dict[tuple[int, int], Bracket] = {}  # (line, column) -> the bracket there
        pending: list[Bracket] = []  # brackets waiting for their first token
        previous = None
        for t in raw:
            if t.type not in SKIP_TOKENS and pending:
                for b in pending:
                    b.align = t.start[1]
                pending = []
            tok = Tok(t.type, t.string, t.start[0], t.start[1], t.end[0], t.end[1], tuple(stack))
            self.toks.append(tok)
            if t.type == tokenize.OP and t.string in OPEN:
                b = Bracket(t.string, t.start[0], t.start[1], depth=len(stack))
                b.is_subscript = t.string == "[" and previous is not None and (
                    previous.type in (tokenize.NAME, tokenize.STRING)
                    or previous.string in CLOSE) and previous.string not in KEYWORDS
                stack.append(b)
                pending.append(b)
                self.brackets[(b.line, b.col)] = b
            elif t.type == tokenize.OP and t.string in CLOSE and stack:
                closed = stack.pop()
                closed.end_line, closed.end_col = t.start
                if closed in pending:  # empty brackets
                    pending.remove(closed)
                    closed.align = t.start[1]
            if t.type not in SKIP_TOKENS:
                previous = t
        self.docstrings: dict[int, ast.Constant] = {}  # every line of a docstring -> its node
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = _docstring_node(node)
                if doc is not None:
                    for n in range(doc.lineno, (doc.end_lineno or doc.lineno) + 1):
                        self.docstrings[n] = doc

    def line(self, n: int) -> str:
        return self.lines[n - 1].rstrip("\n")

    def line_tokens(self, n: int) -> list[Tok]:
        return [t for t in self.toks if t.line == n]

    def string_spanning(self, n: int) -> Tok | None:
        """The multi-line string token that covers line n, if any."""
        for t in self.toks:
            if t.type == tokenize.STRING and t.line <= n <= t.end_line and t.line != t.end_line:
                return t
        return None


def _docstring_node(node: ast.AST) -> ast.Constant | None:
    if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            return body[0].value
    return None


def normalised_dump(text: str) -> str:
    """The AST of `text` with every docstring's whitespace collapsed to single spaces."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        doc = _docstring_node(node)
        if doc is not None:
            doc.value = " ".join(doc.value.split())
    return ast.dump(tree)


def comment_words(text: str) -> list[str]:
    words: list[str] = []
    for t in tokenize.generate_tokens(io.StringIO(text).readline):
        if t.type == tokenize.COMMENT:
            words.extend(re.sub(r"-{3,}", "---", t.string.lstrip("#")).split())
    return words


def width(text: str) -> int:
    """Columns on screen, as ruff counts them: a wide (East Asian) character takes two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def is_long(line: str, limit: int) -> bool:
    """Whether ruff's E501 counts the line as too long (roughly: one unbroken word is exempt,
    and so is a trailing pragma comment when the code before it fits)."""
    if width(line) <= limit:
        return False
    stripped = line.strip()
    if len(stripped.lstrip("#").split()) <= 1:
        return False
    m = PRAGMA.search(line)
    return not (m and len(line[:m.start()].rstrip()) <= limit)


# ---- prose: comments and docstrings ------------------------------------------------------------

def split_prose(line: str, text_start: int, limit: int) -> tuple[str, str]:
    """Split `line` at the last space at or before `limit` that leaves text on both sides."""
    cut = line.rfind(" ", text_start + 1, limit + 1)
    while cut > text_start and line[cut - 1] == " ":
        cut -= 1
    if cut <= text_start or not line[text_start:cut].strip():
        raise Refused("no space to break the text at")
    return line[:cut].rstrip(), line[cut:].strip()


def hanging_prefix(prefix: str, text: str) -> str:
    m = BULLET.match(text)
    return prefix + " " * len(m.group(0)) if m else prefix


def rewrap_paragraph(src: Source, n: int, text_start: int, cont_prefix: str, limit: int,
                     is_continuation) -> list[str]:
    """New lines for line n: the overflow goes into the next line when `is_continuation(next)`
    says it continues the same paragraph under `cont_prefix`, else onto a new line."""
    line = src.line(n)
    first, overflow = split_prose(line, text_start, limit)
    new = list(src.lines)
    new[n - 1] = first + "\n"
    nxt = src.line(n + 1) if n < len(src.lines) else None
    if nxt is not None and nxt.startswith(cont_prefix) and is_continuation(nxt, cont_prefix):
        new[n] = cont_prefix + overflow + " " + nxt[len(cont_prefix):].lstrip() + "\n"
    else:
        new.insert(n, cont_prefix + overflow + "\n")
    return new


def fix_comment(src: Source, n: int, limit: int) -> list[str]:
    line = src.line(n)
    indent = line[: len(line) - len(line.lstrip())]
    body = line.lstrip()
    if PRAGMA.match(body) or body.startswith("#!"):
        raise Refused("pragma comment")
    rule = RULE.match(body)
    if rule:
        head = indent + rule.group("head")
        if len(head) + 2 > limit:
            raise Refused("rule title too long")
        return _replace(src, n, [head + "-" * (limit - len(head))])
    m = re.match(r"#\s*", body)
    assert m
    prefix = indent + m.group(0)
    text = line[len(prefix):]
    if "  " in text.strip():
        raise Refused("comment with runs of spaces (a table or diagram?)")
    cont = hanging_prefix(prefix, text)

    def continues(nxt: str, cont_prefix: str) -> bool:
        rest = nxt[len(cont_prefix):]
        if not nxt.lstrip().startswith("#") or not rest.strip() or rest[0] == " ":
            return False
        if nxt[: len(cont_prefix)] != cont_prefix or PRAGMA.match(nxt.lstrip()):
            return False
        if RULE.match(nxt.lstrip()) or "  " in rest.strip():
            return False
        return cont_prefix != prefix or not BULLET.match(rest)

    return rewrap_paragraph(src, n, len(prefix), cont, limit, continues)


def _last_column(line: str, text_start: int) -> int | None:
    """The column where a table row's last cell starts (after a run of 2+ spaces), if any."""
    found = [m.end(1) for m in re.finditer(r"\S( {2,})(?=\S)", line) if m.start() >= text_start]
    return found[-1] if found else None


def _under_column(src: Source, n: int, column: int, first_line: int) -> bool:
    """Whether line n continues a table cell that starts at `column` on a line above."""
    for k in range(n - 1, first_line - 1, -1):
        above = src.line(k)
        indent = len(above) - len(above.lstrip())
        if not above.strip() or indent > column:
            return False
        if indent < column:
            return above[column - 2:column] in ("  ", "> ", "# ", " (") \
                and above[column:column + 1] not in ("", " ")
    return False


def _rewrap_cell(src: Source, n: int, column: int, limit: int, last_line: int) -> list[str]:
    """Rewrap a table row's last cell (from `column`) under itself."""
    line = src.line(n)
    if column > limit - 25:
        raise Refused("a table cell too far right to rewrap")
    cell = line[column:]
    hang = re.match(r"(-> |\w+ \(|\()", cell)  # `x  -> y ...`, `name  gauge (what ...`
    if hang and hang.group(0).endswith("(") and _closing_paren(cell, len(hang.group(0)) - 1) \
            < len(cell.rstrip()) - 2:
        hang = None  # `absent (dense experts) or ...`: the parenthesis is not the cell
    cont = " " * (column + (len(hang.group(0)) if hang else 0))
    nxt = src.line(n + 1) if n < last_line else ""
    nxt_indent = len(nxt) - len(nxt.lstrip())
    if nxt.strip() and column <= nxt_indent <= column + 4:
        cont = " " * nxt_indent  # the cell's own continuation lines show where it hangs
    cont += "# " if cell.startswith("# ") else ""

    def continues(nxt: str, cont_prefix: str) -> bool:
        rest = nxt[len(cont_prefix):]
        if n + 1 > last_line or not rest.strip() or rest[0] == " " or "  " in rest.strip():
            return False
        return rest.strip() not in ('"""', "'''") and nxt[:len(cont_prefix)].strip() in ("", "#")

    return rewrap_paragraph(src, n, len(cont), cont, limit, continues)


def _closing_paren(text: str, start: int) -> int:
    """The index of the `)` that closes the `(` at `start` (len(text) when none does)."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def _under_bullet(src: Source, n: int, prefix: str, first_line: int, base: int) -> bool:
    """Whether line n hangs under a bullet: the nearest less indented line above is one."""
    for k in range(n - 1, first_line - 1, -1):
        above = src.line(k)
        if not above.strip():
            return False
        indent, text = len(above) - len(above.lstrip()), above.lstrip()
        if k == first_line:
            indent, text = base, text.lstrip("ruRUbBfF").lstrip("\"'")
        if indent < len(prefix):
            m = BULLET.match(text)
            return bool(m) and indent + len(m.group(0)) == len(prefix)
    return False


def fix_docstring(src: Source, n: int, node: ast.Constant, limit: int) -> list[str]:
    first_line = node.lineno
    start_tok = next(t for t in src.toks if t.type == tokenize.STRING and t.line == first_line
                     and t.col == node.col_offset)
    m = STRING_PREFIX.match(start_tok.string)
    if not m or len(m.group(2)) != 3:
        raise Refused("docstring without triple quotes")
    line = src.line(n)
    base = " " * start_tok.col
    if n == first_line:
        text_start = start_tok.col + len(m.group(0))
        prefix = base
    else:
        prefix = line[: len(line) - len(line.lstrip())]
        text_start = len(prefix)
    text = line[text_start:]
    last_line = node.end_lineno or first_line
    if ">>>" in text or "|" in text:
        raise Refused("docstring line with a prompt or a bar (a table?)")
    column = _last_column(line, text_start)
    if column is None and n != first_line and len(prefix) > len(base) \
            and _under_column(src, n, len(prefix), first_line):
        column = len(prefix)
    if column is not None:
        return _rewrap_cell(src, n, column, limit, last_line)
    if n != first_line and len(prefix) > len(base) and not BULLET.match(text) \
            and not _under_bullet(src, n, prefix, first_line, len(base)):
        raise Refused("indented docstring line (a code or schema block?)")
    cont = hanging_prefix(prefix, text)

    def continues(nxt: str, cont_prefix: str) -> bool:
        rest = nxt[len(cont_prefix):]
        if n + 1 > last_line or not rest.strip() or rest[0] == " ":
            return False
        if rest.strip() in ('"""', "'''") or "  " in rest.strip() or ">>>" in rest:
            return False
        return cont_prefix != prefix or not BULLET.match(rest)

    return rewrap_paragraph(src, n, text_start, cont, limit, continues)


# ---- code ----------------------------------------------------------------------------------------

def _replace(src: Source, n: int, lines: list[str]) -> list[str]:
    new = list(src.lines)
    new[n - 1:n] = [ln + "\n" for ln in lines]
    return new


def move_trailing_comment(src: Source, n: int, comment: Tok) -> list[str]:
    line = src.line(n)
    code = line[: comment.col].rstrip()
    first = next(t for t in src.toks if t.end_line >= n and t.type not in SKIP_TOKENS)
    if first.line != n:
        raise Refused("the line continues a multi-line string")
    if code.endswith("\\"):
        raise Refused("backslash continuation")
    indent = line[: len(line) - len(line.lstrip())]
    text = comment.string.lstrip("#").strip()
    return _replace(src, n, [indent + "# " + text, code])


def _spans(b: Bracket, n: int, limit: int) -> bool:
    """Whether bracket b holds what overflows line n (it is still open at the limit)."""
    return b.end_line > n or b.end_col >= limit


def break_candidates(src: Source, n: int,
                     limit: int) -> list[tuple[tuple[int, ...], int, int, Bracket]]:
    """(preference key, column to break at, continuation column, bracket) for line n, best
    first: the outermost bracket, commas before operators, lists before subscripts, the
    loosest operator, the rightmost place."""
    toks = [t for t in src.line_tokens(n) if t.type not in SKIP_TOKENS]
    line = src.line(n)
    indent = len(line) - len(line.lstrip())
    out: list[tuple[tuple[int, ...], int, int, Bracket]] = []
    for i, t in enumerate(toks[:-1]):
        nxt = toks[i + 1]
        if nxt.line != n or t.end_line != n:
            continue
        if t.type == tokenize.OP and t.string == "," and t.open:
            if _in_target_or_lambda(toks[:i], t.open):
                continue
            b = t.open[-1]
            key = (int(b.is_subscript), int(not _spans(b, n, limit)), b.depth, 0, 0,
                   -t.end_col)
            at = t.end_col
        elif i > 0 and nxt.open and (
                (nxt.type == tokenize.NAME and nxt.string in BREAK_BEFORE_WORDS)
                or (nxt.type == tokenize.OP and nxt.string in BREAK_BEFORE_OPS
                    and _is_operand_end(t))):
            if nxt.string == "for" and t.string == "async":
                continue
            if nxt.string in ("if", "else", "for") and t.string in (",", "(", "[", "{"):
                continue
            if nxt.string == "else" and not any(x.string == "if" and x.open == nxt.open
                                                for x in toks[:i]):
                continue
            b = nxt.open[-1]
            in_comprehension = nxt.string == "for" or (nxt.string == "if" and any(
                x.string == "for" and x.open == nxt.open for x in toks[:i]))
            if not in_comprehension and _in_keyword_value(toks[:i + 1], nxt.open):
                continue  # an operator in a keyword's or a key's value: break between items
            key = (int(b.is_subscript), int(not _spans(b, n, limit)), b.depth, 1,
                   PRECEDENCE[nxt.string], -nxt.col)
            at = nxt.col
        else:
            continue
        align = b.align
        if b.line < n and toks[0].open == t.open and toks[0] is not t:
            align = indent  # a continuation line in b: keep its own alignment
        if any(x.col >= at and x.type == tokenize.OP and x.string in OPEN
               and _bracket_at(src, x).end_line > n for x in toks):
            continue  # it would move a bracket that later lines are aligned under
        out.append((key, at, align, b))
    out.sort(key=lambda c: c[0])
    return out


def _bracket_at(src: Source, tok: Tok) -> Bracket:
    return src.brackets[(tok.line, tok.col)]


def _in_keyword_value(before: list[Tok], open_: tuple[Bracket, ...]) -> bool:
    """Whether the item that `before` ends in (in the brackets `open_`) is `name=value`,
    `key: value` or a lambda so far."""
    for t in reversed(before):
        if t.open != open_:
            continue
        if t.string == ",":
            return False
        if t.string in ("=", ":", "lambda"):
            return True
    return False


def _in_target_or_lambda(before: list[Tok], open_: tuple[Bracket, ...]) -> bool:
    """Whether a comma after `before` (in the brackets `open_`) separates a for-target's names
    or a lambda's parameters."""
    for t in reversed(before):
        if t.open != open_ or t.type not in (tokenize.NAME, tokenize.OP):
            continue
        if t.string in ("in", ":"):
            return False
        if t.string in ("for", "lambda"):
            return True
    return False


def _is_operand_end(t: Tok) -> bool:
    if t.type in (tokenize.NAME, tokenize.NUMBER, tokenize.STRING):
        return t.string not in ("and", "or", "not", "in", "is", "if", "else", "lambda", "return")
    return t.type == tokenize.OP and t.string in CLOSE


def break_code(src: Source, n: int, limit: int, max_depth: int = 99,
               cascade: bool = True) -> list[str]:
    line = src.line(n)
    for key, at, align, bracket in break_candidates(src, n, limit):
        head, tail = line[:at].rstrip(), line[at:].strip()
        if len(head) > limit or not tail or align < 0 or key[2] > max_depth:
            continue
        second = " " * align + tail
        if len(second) >= len(line) or align > 75:
            continue
        shift = align - (len(line) - len(line[at:].lstrip()))
        if len(second) > limit and bracket.end_line == n and bracket.end_col + shift < limit:
            continue  # what overflows is after the bracket: breaking in it does not help
        out = [head, second]
        nxt = src.line(n + 1) if n < len(src.lines) else ""
        nxt_toks = [t for t in src.line_tokens(n + 1) if t.type not in SKIP_TOKENS] \
            if nxt else []
        if (tail.endswith(",") and nxt_toks and nxt_toks[0].col == align
                and nxt_toks[0].open and nxt_toks[0].open[-1] is bracket
                and not any(t.type == tokenize.COMMENT for t in src.line_tokens(n + 1))
                and src.string_spanning(n + 1) is None
                and (len(second) + 1 + len(nxt.strip()) <= limit or (cascade and len(tail) < 25))):
            merged = _replace_many(src, n, 2, [head, second + " " + nxt.strip()])
            if len(second) + 1 + len(nxt.strip()) <= limit:
                return merged
            try:  # a short tail joins the next line, which must then break again
                break_code(Source("".join(merged)), n + 1, limit, cascade=False)
                return merged
            except (Refused, SyntaxError):
                pass
        return _replace(src, n, out)
    raise Refused("no comma or operator to break at")


def _replace_many(src: Source, n: int, count: int, lines: list[str]) -> list[str]:
    new = list(src.lines)
    new[n - 1:n - 1 + count] = [ln + "\n" for ln in lines]
    return new


def split_string(src: Source, n: int, limit: int) -> list[str]:
    """Split the string literal that crosses the limit into an implicit concatenation."""
    line = src.line(n)
    toks = [t for t in src.line_tokens(n) if t.type not in SKIP_TOKENS]
    for i, t in enumerate(toks):
        if t.type != tokenize.STRING or t.end_line != n or t.line != n:
            continue
        if not (t.col < limit - 10 and t.end_col > limit - 20):
            continue
        m = STRING_PREFIX.match(t.string)
        if not m or len(m.group(2)) == 3 or "\\N{" in t.string:
            raise Refused("string with triple quotes or \\N escapes")
        prefix, quote = m.group(1), m.group(2)
        body = t.string[len(m.group(0)):-1]
        neighbours = [x for x in (toks[i - 1] if i else None, toks[i + 1] if i + 1 < len(toks)
                                  else None) if x is not None]
        if any(x.type == tokenize.STRING for x in neighbours):
            raise Refused("string already in an implicit concatenation on this line")
        in_bracket = bool(t.open)
        col = t.col + (0 if in_bracket else 1)
        parts = _split_body(body, prefix, first_room=limit - t.col - len(prefix) - 2,
                            room=limit - col - len(prefix) - 2, tail=len(line[t.end_col:].rstrip())
                            + (0 if in_bracket else 1))
        if len(parts) < 2:
            raise Refused("no space in the string to split at")
        literals = [_literal(prefix, quote, p) for p in parts]
        before, after = line[: t.col], line[t.end_col:]
        merged = _merge_into_next(src, n, t, in_bracket, col, after, literals[-1], limit)
        if merged is not None:
            out = [before + literals[0]] + [" " * col + lit for lit in literals[1:-1]]
            return _replace_many(src, n, 2, out + [merged])
        if in_bracket:
            out = [before + literals[0]] + [" " * col + lit for lit in literals[1:]]
            out[-1] += after
        else:
            out = [before + "(" + literals[0]] + [" " * col + lit for lit in literals[1:]]
            out[-1] += ")" + after
        if len(out[-1]) > limit and len(out[-1]) >= len(line):
            raise Refused("the code after the string still does not fit")
        return _replace(src, n, out)
    raise Refused("no string crosses the limit")


def _merge_into_next(src: Source, n: int, t: Tok, in_bracket: bool, col: int, after: str,
                     last: str, limit: int) -> str | None:
    """The next line with the split's last piece joined to the string it starts with, when it
    continues the same implicit concatenation at the same column (None when it does not)."""
    if not in_bracket or after.strip() or n >= len(src.lines):
        return None
    nxt_toks = [x for x in src.line_tokens(n + 1) if x.type not in SKIP_TOKENS]
    if not nxt_toks or nxt_toks[0].type != tokenize.STRING or nxt_toks[0].col != col:
        return None
    first = nxt_toks[0]
    if first.end_line != n + 1 or first.open != t.open:
        return None
    m1, m2 = STRING_PREFIX.match(last), STRING_PREFIX.match(first.string)
    if not m1 or not m2 or len(m2.group(2)) == 3:
        return None
    p1, p2 = m1.group(1).lower(), m2.group(1).lower()
    if p1.replace("f", "") != p2.replace("f", "") or "r" in p1:
        return None
    body1, body2 = last[len(m1.group(0)):-1], first.string[len(m2.group(0)):-1]
    quote = m2.group(2)
    if quote in body1 or "\\" in body1:
        return None
    if ("f" in p1) != ("f" in p2) and ("{" in body1 + body2 or "}" in body1 + body2):
        return None
    prefix = m2.group(1) if "f" in p2 or "f" not in p1 else "f" + m2.group(1)
    nxt = src.line(n + 1)
    return nxt[:first.col] + prefix + quote + body1 + body2 + quote + nxt[first.end_col:]


def _literal(prefix: str, quote: str, body: str) -> str:
    if "f" in prefix.lower() and "{" not in body and "}" not in body:
        prefix = prefix.replace("f", "").replace("F", "")
    return prefix + quote + body + quote


def _split_body(body: str, prefix: str, first_room: int, room: int, tail: int) -> list[str]:
    """Split a string literal's body after spaces (never inside an f-string's braces or after a
    backslash) into pieces of at most `room` characters (`first_room` for the first; the last
    leaves `tail` characters for the code after the string)."""
    is_f = "f" in prefix.lower()
    safe: list[int] = []  # indices just after a space where a cut keeps the value
    depth = 0
    i = 0
    while i < len(body):
        c = body[i]
        if is_f and c in "{}":
            if i + 1 < len(body) and body[i + 1] == c:
                i += 2
                continue
            depth += 1 if c == "{" else -1
        elif c == "\\":
            i += 2
            continue
        elif c == " " and depth == 0 and i + 1 < len(body) and body[i + 1] != " ":
            safe.append(i + 1)
        i += 1
    parts: list[str] = []
    start = 0
    limit = first_room
    while len(body) - start + tail > limit:
        cuts = [c for c in safe if start < c <= start + limit]
        if not cuts:
            break
        parts.append(body[start:cuts[-1]])
        start = cuts[-1]
        limit = room
    parts.append(body[start:])
    return [p for p in parts if p]


def parenthesise(src: Source, n: int, limit: int) -> list[str]:
    """Put parentheses around the expression of a one-line simple statement on line n."""
    for node in ast.walk(src.tree):
        if not isinstance(node, ast.stmt) or node.lineno != n:
            continue
        if node.end_lineno != n and not (isinstance(node, ast.If | ast.While)
                                         and node.test.end_lineno == n):
            continue
        target: ast.expr | None = None
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.Return):
            target = node.value
        elif isinstance(node, ast.Assert):
            target = node.test if (node.test.end_col_offset or 0) > limit or node.msg is None \
                else node.msg
        elif isinstance(node, ast.If | ast.While):
            target = node.test
        if target is None or not isinstance(target, ast.BoolOp | ast.Compare | ast.BinOp
                                                 | ast.IfExp | ast.Tuple):
            continue
        line = src.line(n)
        a, b = target.col_offset, target.end_col_offset or 0
        opening = src.brackets.get((n, a))
        if opening is not None and (opening.end_line, opening.end_col) == (n, b - 1):
            continue  # already in brackets that span it
        wrapped = line[:a] + "(" + line[a:b] + ")" + line[b:]
        inner = Source("".join(_replace(src, n, [wrapped])))
        depth = len(next(t for t in inner.line_tokens(n) if t.col == a + 1).open) - 1
        return break_code(inner, n, limit, max_depth=depth)
    raise Refused("no operator to break at in a parenthesised expression")


def hang_signature(src: Source, n: int, limit: int, pragma: Tok | None = None) -> list[str]:
    """`def name(params) -> T:` too long: the parameters go on the next lines, indented by 8
    (and are broken there); the signature may span lines, with no comment in it but a pragma
    at the end of its one line, which stays on the `def` line (where mypy reports)."""
    for node in ast.walk(src.tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first = next(t for t in src.toks if t.line >= node.lineno and t.string == "def")
        paren = next(t for t in src.toks if (t.line, t.col) > (first.line, first.col)
                     and t.string == "(")
        bracket = src.brackets[(paren.line, paren.col)]
        colon = next(t for t in src.toks if (t.line, t.col) > (bracket.end_line, bracket.end_col)
                     and t.string == ":" and len(t.open) == 0)
        if not paren.line <= n <= colon.line or paren.line != first.line:
            continue
        if any(t.type == tokenize.COMMENT and paren.line <= t.line <= colon.line
               and t is not pragma for t in src.toks):
            raise Refused("a comment in the signature")
        if pragma is not None and not (paren.line == colon.line == pragma.line):
            raise Refused("a pragma on a signature of several lines")
        if bracket.align == bracket.col + 1 and bracket.line == paren.line and n == paren.line \
                and bracket.end_line == n:
            pass  # one line: hang it
        elif src.line(paren.line).rstrip().endswith("("):
            raise Refused("the signature hangs already")
        head = src.line(paren.line)[: paren.col + 1]
        first_line = src.line(paren.line)
        if pragma is not None:
            first_line = first_line[:pragma.col].rstrip()
        pieces = [first_line[paren.col + 1:].strip()]
        pieces += [src.line(k).strip() for k in range(paren.line + 1, colon.line + 1)]
        indent = len(head) - len(head.lstrip())
        body = " ".join(p for p in pieces if p).replace("( ", "(")
        if pragma is not None:
            head += "  " + pragma.string
        return _replace_many(src, paren.line, colon.line - paren.line + 1,
                             [head, " " * (indent + 8) + body])
    raise Refused("not a signature")


# ---- driver ----------------------------------------------------------------------------------

def fix_line(src: Source, n: int, limit: int) -> list[str]:
    line = src.line(n)
    if width(line) != len(line):
        raise Refused("wide characters (the fixes count characters, not columns)")
    if n in src.docstrings:
        return fix_docstring(src, n, src.docstrings[n], limit)
    if src.string_spanning(n) is not None:
        raise Refused("inside a multi-line string (its text is a value)")
    if line.lstrip().startswith("#"):
        return fix_comment(src, n, limit)
    comments = [t for t in src.line_tokens(n) if t.type == tokenize.COMMENT]
    if comments:
        if PRAGMA.match(comments[0].string):
            if re.match(r"\s*(async\s+)?def ", line) and len(comments) == 1:
                return hang_signature(src, n, limit, pragma=comments[0])
            raise Refused("a pragma comment must stay on its line")
        return move_trailing_comment(src, n, comments[0])
    if line.rstrip().endswith("\\"):
        raise Refused("backslash continuation")
    for attempt in (parenthesise, break_code, split_string, hang_signature):
        try:
            return attempt(src, n, limit)
        except Refused:
            continue
    raise Refused("no comma, operator or string to break at")


def fix_file(path: Path, limit: int, dry_run: bool) -> tuple[int, list[str]]:
    """Fix `path` in place; return (number of fixes, refusals as 'path:line: reason')."""
    original = path.read_text()
    want_ast, want_comments = normalised_dump(original), comment_words(original)
    text = original
    refused: dict[str, str] = {}  # refused line's text -> reason
    num_fixes = 0
    for _ in range(20 * len(original.splitlines()) + 1):
        src = Source(text)
        todo = [n for n in range(1, len(src.lines) + 1)
                if is_long(src.line(n), limit) and src.line(n) not in refused]
        if not todo:
            break
        n = todo[0]
        try:
            candidate = "".join(fix_line(src, n, limit))
            try:
                same = (normalised_dump(candidate) == want_ast
                        and comment_words(candidate) == want_comments)
            except SyntaxError:
                same = False
            if not same:
                raise Refused("the fix would change the AST or the comments")
        except Refused as exc:
            refused[src.line(n)] = str(exc)
            continue
        text = candidate
        num_fixes += 1
    reports = []
    final = text.splitlines()
    for i, line in enumerate(final, 1):
        if is_long(line, limit):
            reports.append(f"{path}:{i}: {refused.get(line, 'still too long')}")
    if text != original and not dry_run:
        path.write_text(text)
    return num_fixes, reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--max-length", type=int, default=100)
    parser.add_argument("--dry-run", action="store_true", help="report, do not write")
    args = parser.parse_args(argv)
    total, left = 0, []
    for path in args.files:
        num_fixes, reports = fix_file(path, args.max_length, args.dry_run)
        total += num_fixes
        left.extend(reports)
    for report in left:
        print(report)
    print(f"{total} fixes, {len(left)} lines left too long", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
