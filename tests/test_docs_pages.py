"""The documentation's Python code blocks run (docs/*.md, benchmarks/README.md): the
blocks of one page in order in one fresh process, sharing names, as a reader follows
the page, with a user's environment (tests/test_docs.py: `run_script`). A file of its
own so that the two test processes can share the pages and the README's blocks."""

import pytest

from test_docs import PAGES, ROOT, python_blocks, run_script


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_page_blocks_run(page, tmp_path):
    run_script("\n".join(python_blocks(page)), tmp_path, page.stem)
