"""The documentation site: `mkdocs build --strict` and what the built pages contain.

The site (mkdocs.yml, docs/) is built once into a temporary folder with `--strict`, so a
cross-reference that does not resolve (in a page or in a docstring the API reference
renders), a page missing from the navigation or a broken link fails here, as in CI. The
built HTML is then checked: every public name of every public package has an entry in
the API reference, pages carry their titles, and the equations reach the page as the
markup MathJax typesets (`pymdownx.arithmatex`). The slow test opens the built pages in
headless Chromium and checks what a reader sees.
"""

from __future__ import annotations

import functools
import html
import importlib
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# every package whose `__all__` is public API, and so must be in the reference
PACKAGES = (
    "itde",
    "itde.function",
    "itde.interop",
    "itde.studies",
    "itde.data",
    "itde.cli",
    "itde.analysis",
    "itde.train",
    "itde_solvers",
)
# names re-exported by `itde` from a subpackage are documented under the subpackage
REEXPORTED_FROM = {"itde.function", "itde.interop"}


def _need(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:  # a missing tool is a failure, not a skip: install the docs extra
        pytest.fail(f"`{module}` is not installed: `pip install -e '.[docs]'` (the docs extra).")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built with `mkdocs build --strict` into a temporary folder."""
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        _need(module)
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    warnings = [line for line in log.splitlines() if "WARNING" in line or "ERROR" in line]
    assert proc.returncode == 0, "`mkdocs build --strict` failed:\n" + "\n".join(warnings or [log])
    # the theme's end-of-life banner is off (mkdocs.yml: its variable, set above)
    assert "NO_MKDOCS_2_WARNING" not in log and "end of life" not in log, log[:2000]
    return out


def _page(site: Path, path: str) -> str:
    return (site / path / "index.html").read_text(encoding="utf-8")


def _anchor_ids(site: Path) -> set[str]:
    ids = set()
    for page in site.rglob("*.html"):
        ids.update(re.findall(r'\bid="([^"]+)"', page.read_text(encoding="utf-8")))
    return ids


def test_site_builds_strict_and_documents_every_public_name(site):
    ids = _anchor_ids(site)
    missing = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            home = getattr(obj, "__module__", "") or ""
            if package == "itde" and any(home.startswith(p) for p in REEXPORTED_FROM):
                target = next(p for p in REEXPORTED_FROM if home.startswith(p)) + "." + name
            else:
                target = f"{package}.{name}"
            if target not in ids:
                missing.append(target)
    assert not missing, (
        "public names without an entry in the API reference (add `::: NAME` to a page "
        f"under docs/api/): {missing}"
    )


def test_pages_have_titles_and_equation_markup(site):
    index = _page(site, "")
    assert re.search(r"<title>itde</title>", index), "the index page's title"
    assert "<h1" in index and "the Transformer as an integro-differential equation" in index

    api = _page(site, "api/equation")
    title = re.search(r"<title>(.*?)</title>", api).group(1)
    assert html.unescape(title) == "The equation and the solve - itde"
    # a docstring's $...$ reaches the page as MathML, rendered at build time (docs/hooks.py)
    inline = re.findall(r'<span class="arithmatex"><math[^>]*display="inline"[^>]*>(.*?)</math>',
                        api, flags=re.S)  # fmt: skip
    assert any("&#x00394;" in m or "\u0394" in m for m in inline), "Delta t = 1 in MathML"
    maths = _page(site, "mathematics")
    display = re.findall(r'<div class="arithmatex"><math[^>]*display="block"', maths)
    assert len(display) >= 3, "the equations of the maths page, as block MathML"
    # no TeX source is left on a page, and no script comes from elsewhere (no CDN)
    for page in (api, maths):
        text = re.sub(r"<(script|pre|code).*?</\1>", "", page, flags=re.S)
        assert "\\(" not in text and "\\Delta" not in text
        assert not re.findall(r'<script src="https?://', page)
    # and a cross-reference became a link to the object's entry
    assert 'href="../quadrature/#itde.Grid"' in api  # [`Grid`][itde.Grid], another page


def test_no_page_shows_a_dollar_of_unrendered_mathematics(site):
    """Every `$...$` and `$$...$$` of the docs and docstrings became MathML: no `$` is left
    in a page's text (outside code). Arithmatex leaves `$u = $` (a space before the closing
    dollar) and a `$$...$$` inside a paragraph as raw text; both were on pages."""
    stray = []
    for page in sorted(site.rglob("*.html")):
        text = re.sub(r"<(pre|code|script|style|math)\b.*?</\1>", "", page.read_text("utf-8"),
                      flags=re.S)  # fmt: skip
        text = html.unescape(re.sub(r"<[^>]+>", " ", text))
        stray += [f"{page.relative_to(site)}: ...{m.group(0)}..."
                  for m in re.finditer(r".{0,30}\$.{0,30}", text)]  # fmt: skip
    assert not stray, "unrendered mathematics:\n" + "\n".join(stray)


def test_no_reference_entry_is_empty(site):
    """Every attribute, function and class entry of the API reference has a description:
    a dataclass field is described in its class's docstring (checked by
    `test_layout.py`) and gets no entry of its own, instead of an empty one (there were
    526 of 583)."""
    empty = []
    for page in sorted((site / "api").rglob("*.html")):
        text = page.read_text("utf-8")
        for m in re.finditer(r'<div class="doc doc-object doc-(\w+)">\s*<h\d id="([^"]+)"', text):
            body = re.search(r'<div class="doc doc-contents[^"]*">(.*?)</div>',
                             text[m.end():], flags=re.S)  # fmt: skip
            if body is None or not re.sub(r"<[^>]+>|\s", "", body.group(1)):
                empty.append(f"{m.group(2)} ({m.group(1)})")
    assert not empty, f"{len(empty)} reference entries without a description: {empty[:20]}"


def test_cli_page_lists_every_command_option_and_file(site):
    """The command-line page is generated from the parser: every command, every option of
    each, and every file a command says it writes appear on it."""
    import argparse

    from itde.cli._internal import _main

    page = html.unescape(_page(site, "api/cli"))
    parser = _main.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert len(subs.choices) >= 5
    for name, sub in subs.choices.items():
        assert f"itde {name}" in page, name
        for action in sub._actions:
            if action.help == argparse.SUPPRESS:  # a deprecated alias, out of help and page
                continue
            for flag in action.option_strings:
                assert flag in page, (name, flag)
        sub.format_help()
        for line in (sub.epilog or "").splitlines()[1:]:
            if line.startswith("  ") and line.split():
                assert line.split()[0] in page, (name, line)
    assert "metrics.jsonl" in page and "--no-progress" in page


# ----------------------------------------------------------------------- browser
def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail("the browser test needs Chromium: `apt-get install chromium`.")


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_pages_render_in_a_headless_browser(site, tmp_path, tmp_path_factory):
    sync_api = _need("playwright.sync_api")
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}/"

    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            # nothing leaves the machine (the site needs nothing from elsewhere)
            page.route(re.compile(r"^https?://(?!127\.0\.0\.1).*"), lambda r: r.abort())

            page.goto(base, wait_until="networkidle")
            assert page.title() == "itde"
            assert "integro-differential" in page.locator("h1").first.inner_text()
            page.wait_for_selector("article math", timeout=60_000)
            page.screenshot(path=str(tmp_path / "index.png"))

            page.goto(base + "api/equation/", wait_until="networkidle")
            assert page.title() == "The equation and the solve - itde"
            h1 = page.locator("h1").first.inner_text()
            assert h1.removesuffix("¤").strip() == "The equation and the solve"  # ¤: permalink
            page.wait_for_selector("article math", timeout=60_000)
            # typeset: every equation is MathML the browser laid out, no TeX source to read
            maths = page.locator("article .arithmatex")
            assert maths.count() > 20
            assert page.locator("article .arithmatex:has(math)").count() == maths.count()
            box = page.locator("article .arithmatex math").first.bounding_box()
            assert box is not None and box["width"] > 5 and box["height"] > 5
            assert "\\Delta" not in page.locator("article").inner_text()
            page.screenshot(path=str(tmp_path / "api_equation.png"), full_page=False)
            browser.close()
    finally:
        server.shutdown()
    for shot in ("index.png", "api_equation.png"):
        assert (tmp_path / shot).stat().st_size > 10_000, f"{shot} is a blank screenshot"


def test_convert_pytorch_page_runs_and_says_what_converts():
    """The how-to page's Python blocks run as written, in order, and what it says converts
    does: it once called a pre-LN encoder an error while `from_torch` converted it."""
    page = (ROOT / "docs" / "how-to" / "convert-pytorch.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert len(blocks) >= 2
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # run as written, in this process
        exec(compile("\n".join(blocks), "convert-pytorch.md", "exec"), {})
    out = printed.getvalue()
    errors = [float(line) for line in out.split() if re.fullmatch(r"[0-9.e+-]+", line)]
    assert errors and max(errors) < 1e-5, out  # the printed differences: round-off
    assert "pre-LN (`norm_first=True`: `block=itde.PreNorm()`" in page
    import torch

    import itde

    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, norm_first=True)
    assert isinstance(itde.from_torch(layer).block, itde.PreNorm)


def test_the_index_links_every_how_to_page_in_the_navigations_order():
    """The index's list of how-to guides is docs/how-to/, in mkdocs.yml's order: it once
    left out the Hugging Face families and the fine-tuning pages."""
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    linked = re.findall(r"\]\((how-to/[\w-]+\.md)\)", index)
    pages = sorted(f"how-to/{p.name}" for p in (ROOT / "docs" / "how-to").glob("*.md"))
    nav = re.findall(r"'(how-to/[\w-]+\.md)'", (ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert sorted(linked) == pages and linked == nav, linked
