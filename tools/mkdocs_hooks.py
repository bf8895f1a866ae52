"""mkdocs hooks: the site is docs/ plus the repository's README (the home page) and BENCHMARKS.md, and the two
generated references (tools/docsgen.py), built fresh every time so that they cannot drift from the code.

Pages keep the links that work on the repository's own web view (`../BENCHMARKS.md` from docs/, `docs/cli.md` from
the README); `on_page_markdown` maps them onto the site's layout, so a link that points nowhere still fails
`mkdocs build --strict`.
"""

from __future__ import annotations

import posixpath
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # mkdocs loads this file by path: `tools` is importable from the repository root

from tools import docsgen  # noqa: E402

# repository file -> its page on the site
ROOT_PAGES = {"README.md": "index.md", "BENCHMARKS.md": "BENCHMARKS.md"}
LINK = re.compile(r"(\]\()([^)\s#]+)([^)]*\))")


def on_files(files, config):
    for source, page in ROOT_PAGES.items():
        files.append(File.generated(config, page, abs_src_path=str(ROOT / source)))
    for page, render in docsgen.GENERATED.items():
        files.append(File.generated(config, page, content=render()))
    return files


def on_page_markdown(markdown, page, config, files):
    from_root = page.file.src_uri == "index.md"  # the README: its links are relative to the repository root
    here = posixpath.dirname(page.file.src_uri)

    def relink(match: re.Match) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("mailto:", "/")):
            return match.group(0)
        if from_root:
            repo_path = posixpath.normpath(target)
        else:
            repo_path = posixpath.normpath(posixpath.join("docs", here, target))
        if repo_path in ROOT_PAGES:
            site_path = ROOT_PAGES[repo_path]
        elif repo_path.startswith("docs/"):
            site_path = repo_path.removeprefix("docs/") + ("/" if target.endswith("/") else "")
        else:
            return match.group(0)  # outside the site: left for mkdocs to report
        relative = posixpath.relpath(site_path, here or ".") + ("/" if site_path.endswith("/") else "")
        return match.group(1) + relative + match.group(3)

    return LINK.sub(relink, markdown)
