"""Build hooks of the documentation site: the command-line page is generated from the
`itde` parser, so it lists every command, option and file the code has."""

MARKER = "<!-- cli-reference -->"


def on_page_markdown(markdown, page, **kwargs):
    if MARKER in markdown:
        from itde.cli._reference import reference_markdown

        markdown = markdown.replace(MARKER, reference_markdown())
    return markdown
