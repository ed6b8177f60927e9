"""The chart's values table in docs/configuration.md is exactly what helm-docs (built from its Go
module at the pinned version) renders from values.yaml; a value added with a `# --` comment shows
up in the table, one added without a comment is refused (strict mode), and a document without the
table's markers is an error. Skipped, with the build error as reason, only where helm-docs cannot
be built (no Go toolchain, no module proxy)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from localcluster import build, chart_docs


@pytest.fixture(scope="module")
def helm_docs() -> Path:
    try:
        return build.build(build.HELM_DOCS)
    except build.BuildError as err:
        pytest.skip(f"helm-docs {build.HELM_DOCS_VERSION} cannot be built here: {err}")


def test_committed_values_table_matches_values_yaml(helm_docs: Path) -> None:
    document = chart_docs.DOC.read_text()
    table = chart_docs.values_table(helm_docs)
    assert "| replicaCount | int | `2` |" in table
    assert chart_docs.replace_table(document, table) == document, (
        "the values table in docs/configuration.md drifted from values.yaml: run `make docs` and commit"
    )
    assert chart_docs.main(["--check"]) == 0


def test_new_values_need_a_comment_and_appear_in_the_table(helm_docs: Path, tmp_path: Path) -> None:
    chart = tmp_path / "megatron-operator"
    shutil.copytree(chart_docs.CHART, chart)
    values = chart / "values.yaml"
    values.write_text(values.read_text() + "\n# -- Seconds to wait for a new thing.\nnewThingSeconds: 7\n")
    table = chart_docs.values_table(helm_docs, chart)
    assert "| newThingSeconds | int | `7` | Seconds to wait for a new thing. |" in table
    document = chart_docs.DOC.read_text()
    assert chart_docs.replace_table(document, table) != document

    values.write_text(values.read_text() + "\nundocumented: 1\n")
    with pytest.raises(chart_docs.ChartDocsError, match="undocumented"):
        chart_docs.values_table(helm_docs, chart)


def test_replace_table_needs_the_markers() -> None:
    doc = f"intro\n{chart_docs.BEGIN}\nold\n{chart_docs.END}\nafter\n"
    assert (
        chart_docs.replace_table(doc, "| new |") == f"intro\n{chart_docs.BEGIN}\n\n| new |\n\n{chart_docs.END}\nafter\n"
    )
    with pytest.raises(chart_docs.ChartDocsError):
        chart_docs.replace_table("no markers here", "| new |")
