"""Build hooks of the documentation site.

- The command-line page is generated from the `itde` parser, so it lists every command,
  option and file the code has.
- Mathematics is rendered at build time: each formula `pymdownx.arithmatex` marks
  (`$...$`, `$$...$$`) becomes MathML (`latex2mathml`), which browsers typeset natively;
  the site loads no script from elsewhere and shows no TeX source.
"""

import html
import re

MARKER = "<!-- cli-reference -->"
_MATH = re.compile(r'<(span|div) class="arithmatex">(.*?)</\1>', re.S)


def on_page_markdown(markdown, page, **kwargs):
    if MARKER in markdown:
        from itde.cli._reference import reference_markdown

        markdown = markdown.replace(MARKER, reference_markdown())
    return markdown


def _mathml(match) -> str:
    from latex2mathml.converter import convert

    kind, body = match.group(1), html.unescape(match.group(2)).strip()
    tex = body[2:-2] if body[:2] in ("\\(", "\\[") else body
    display = "block" if kind == "div" else "inline"
    return f'<{kind} class="arithmatex">{convert(tex, display=display)}</{kind}>'


def on_post_page(output, page, config, **kwargs):
    return _MATH.sub(_mathml, output)
