"""docs/debugging.md runs as written: its first python block saved as gemma_runner.py, then each fragment
(check, compare, fix) run next to it in a fresh interpreter. The fragments assert their own results
(the drift finding at the transformers line, the localised divergence, the fixed model equal to the
original one)."""

import pytest
from extras_util import require

from tests.test_docs_examples import ROOT, python_blocks, run_block

pytestmark = pytest.mark.hf


@pytest.mark.slow
def test_check_compare_fix_walkthrough(tmp_path):
    require("transformers")
    blocks = python_blocks((ROOT / "docs" / "debugging.md").read_text(), "docs/debugging.md")
    module, steps = blocks[0], blocks[1:]
    assert not module.fragment and "def make(" in module.code
    assert len(steps) == 3 and all(b.fragment for b in steps)
    (tmp_path / "gemma_runner.py").write_text(module.code)
    for block in steps:
        proc = run_block(block.code, tmp_path)
        assert proc.returncode == 0, f"docs/debugging.md:{block.line}:\n{proc.stderr[-3000:]}"
