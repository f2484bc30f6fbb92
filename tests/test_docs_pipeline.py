"""docs/pipeline-parallel.md: its code is the example's (run by test_examples.py), and what it says about torchtitan's
PP trainer and torch 2.13's schedules is what their sources say."""

import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "pipeline-parallel.md"


def test_the_pages_stage_and_step_are_the_examples_code():
    text = PAGE.read_text()
    section = text[text.index("## Using the fix with torch's pipelining"):text.index("### Microbatches of a packed batch")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    source = (ROOT / "examples" / "pipeline_parallel.py").read_text()
    assert len(blocks) == 2
    for block in blocks:
        assert block in source, block[:200]


def test_torchtitans_trainer_calls_a_step_signature_torch_2_13_lacks():
    trainer = pytest.importorskip("torchtitan.trainer")
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    called = inspect.getsource(trainer.Trainer.pp_forward_backward_step)
    assert re.search(r"self\.pp_schedule\.step\(\s*arg_mbs=", called) and "kwarg_mbs=kwarg_mbs" in called
    for cls in (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B):
        params = inspect.signature(cls.step).parameters
        assert "arg_mbs" not in params and "kwarg_mbs" not in params
        assert params["kwargs"].kind is inspect.Parameter.VAR_KEYWORD, "so arg_mbs=... becomes a model keyword"
