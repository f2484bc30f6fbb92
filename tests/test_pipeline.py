"""Pipeline parallelism without processes: microbatches of a packed batch, the schedule rules, the stage layout,
the per-microbatch ``seqlens``, the audit's region tags and the regression spec's PP fields.

Expected values are worked out by hand in the comments (bin packing, cut points) or come from another source
(torchtitan's own stage layout, torch's own schedule constructor for the microbatch rules).
"""

import itertools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fla_ac_isolation import LayerLocalSeqlens, ReplayAudit
from fla_ac_isolation.harness.modes import SharedSeqlens
from fla_ac_isolation.harness.regression.schedule import SCHEDULES, build_schedule, check_schedule, stage_indices
from fla_ac_isolation.harness.regression.spec import PP1_REFERENCE, RegressionSpec
from fla_ac_isolation.parallel import StageRegionTags, microbatch_seqlens, split_packed_microbatches

LENS = (13, 0, 70, 7, 21, 5, 33, 9, 1, 17)  # 176 tokens, 9 non-empty documents
OFFSETS = [0, *itertools.accumulate(LENS)]


def _batch():
    ids = torch.arange(176)[None] + 1000
    labels = torch.arange(176)[None]
    return {"input_ids": ids, "labels": labels}


def test_documents_are_bin_packed_longest_first_and_keep_their_order_inside_a_microbatch():
    # longest first to the lighter microbatch (ties: the lower index): 70->0, 33->1, 21->1 (54), 17->1 (71),
    # 13->0 (83), 9->1 (80), 7->1 (87), 5->0 (88), 1->1 (88), 0->0 (tie at 88)
    mb = split_packed_microbatches(_batch(), OFFSETS, 2)
    assert mb.documents == ((0, 1, 2, 5), (3, 4, 6, 7, 8, 9))
    assert mb.seq_lens == ((13, 0, 70, 5), (7, 21, 33, 9, 1, 17))
    assert mb.num_tokens == (88, 88) and mb.tokens == 88 and mb.padding == 0
    assert mb.cu_seqlens_cpu.tolist() == [[0, 13, 13, 83, 88, 88, 88, 88], [0, 7, 28, 61, 70, 71, 88, 88]]
    assert mb.cu_seqlens.dtype == torch.int32 and mb.cu_seqlens.device.type == "cpu"
    # every microbatch holds exactly its documents' tokens, in batch order
    ids = _batch()["input_ids"][0]
    for row, docs in zip(mb.tensors["input_ids"], mb.documents):
        expected = torch.cat([ids[OFFSETS[d]:OFFSETS[d + 1]] for d in docs])
        assert torch.equal(row, expected)


def test_microbatches_are_padded_to_one_token_count_with_one_ignored_document():
    mb = split_packed_microbatches(_batch(), OFFSETS, 3, tokens=80)
    # longest first: 70->0, 33->1, 21->2, 17->2 (38), 13->1 (46), 9->2 (47), 7->1 (53), 5->2 (52), 1->2 (53), 0->1
    assert mb.seq_lens == ((70,), (13, 0, 7, 33), (21, 5, 9, 1, 17))
    assert mb.num_tokens == (70, 53, 53) and mb.tokens == 80 and mb.padding == 3 * 80 - 176
    assert mb.tensors["input_ids"].shape == (3, 80) and mb.tensors["labels"].shape == (3, 80)
    assert mb.tensors["labels"][0, 70:].tolist() == [-100] * 10  # labels: ignored by cross-entropy
    assert mb.tensors["input_ids"][1, 53:].tolist() == [0] * 27  # everything else: 0
    # each row: the documents, ONE padding document, then zero-length documents up to the common width
    assert mb.cu_seqlens_cpu.tolist() == [[0, 70, 80, 80, 80, 80, 80], [0, 13, 13, 20, 53, 80, 80],
                                          [0, 21, 26, 35, 36, 53, 80]]
    for i in range(3):
        seqlens = mb.seqlens(i)
        assert isinstance(seqlens, LayerLocalSeqlens) and seqlens.num_tokens == 80
        assert seqlens.seq_lens()[: len(mb.seq_lens[i])] == list(mb.seq_lens[i])
    custom = split_packed_microbatches(_batch(), OFFSETS, 3, pad_values={"labels": -1, "input_ids": 7})
    assert custom.tensors["labels"][1, 53:].unique().tolist() == [-1]
    assert custom.tensors["input_ids"][1, 53:].unique().tolist() == [7]


def test_documents_are_cut_only_when_asked():
    mb = split_packed_microbatches(_batch(), OFFSETS, 4, split_documents=True, chunk_indices=True)
    # cuts at 176 * p // 4 = 44, 88, 132: the 70-token document (tokens 13..83) crosses 44, the 33-token one
    # (tokens 96..129) none, the 17-token one (159..176) none; 7 (83..90) crosses 88; 21 (90..111) none
    assert mb.seq_lens == ((13, 0, 31), (39, 5), (2, 21, 5, 16), (17, 9, 1, 17))
    assert mb.documents == ((0, 1, 2), (2, 3), (3, 4, 5, 6), (6, 7, 8, 9))
    assert mb.num_tokens == (44, 44, 44, 44)
    assert torch.equal(mb.tensors["input_ids"].reshape(-1), _batch()["input_ids"][0])
    # FLA's chunk schedule (64-token chunks) of each row: the 39-token piece is one chunk
    assert [c.tolist() for c in mb.chunk_indices[:2]] == [[[0, 0], [2, 0]], [[0, 0], [1, 0]]]
    with pytest.raises(ValueError, match=r"num_microbatches must be between 1 and the number of non-empty documents "
                                         r"\(9\): documents are not split unless split_documents=True, got 10"):
        split_packed_microbatches(_batch(), OFFSETS, 10)
    assert split_packed_microbatches(_batch(), OFFSETS, 10, split_documents=True).tokens == 18


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_microbatches": 0}, ValueError, "num_microbatches must be between 1 and the number of non-empty "
                                              "documents (9): documents are not split unless split_documents=True, "
                                              "got 0"),
        ({"num_microbatches": 2, "tokens": 87}, ValueError, "tokens=87 is smaller than the largest microbatch (88 "
                                                            "tokens, documents are not split)"),
        ({"num_microbatches": 2.0}, TypeError, "num_microbatches must be an int, got float"),
        ({"num_microbatches": 2, "tokens": "88"}, TypeError, "tokens must be an int, got str"),
        ({"num_microbatches": 2, "split_documents": 1}, TypeError, "split_documents must be a bool, got 1"),
        ({"num_microbatches": 2, "tokens": 2**31}, ValueError, "tokens=2147483648 does not fit int32 offsets (FLA's dtype)"),
        ({"num_microbatches": 2, "cu_seqlens_cpu": [0.0, 176.0]}, TypeError,
         "cu_seqlens_cpu must hold integer offsets, got dtype torch.float32"),
        ({"num_microbatches": 2, "cu_seqlens_cpu": [0, 90, 80, 176]}, ValueError,
         "cu_seqlens_cpu must be 1-D, non-decreasing offsets starting at 0 (N + 1 >= 2 entries), got [0, 90, 80, 176]"),
        ({"num_microbatches": 2, "tensors": {"input_ids": torch.zeros(1, 175, dtype=torch.long)}}, ValueError,
         "tensors['input_ids'] must be packed as [1, T=176, ...] (cu_seqlens_cpu[-1] tokens on dim 1), got shape "
         "(1, 175)"),
        ({"num_microbatches": 2, "tensors": {"h": torch.zeros(176, 4)}}, ValueError,
         "tensors['h'] must be packed as [1, T=176, ...] (cu_seqlens_cpu[-1] tokens on dim 1), got shape (176, 4)"),
        ({"num_microbatches": 2, "tensors": [torch.zeros(1, 176)]}, TypeError,
         "tensors must be a mapping of names to packed tensors, e.g. {'input_ids': ids}, got list"),
        ({"num_microbatches": 2, "tensors": {"ids": [1, 2]}}, TypeError, "tensors['ids'] must be a torch.Tensor, got "
                                                                         "list"),
    ],
)
def test_bad_microbatch_requests_are_refused_naming_the_argument(kwargs, error, message):
    args = {"tensors": _batch(), "cu_seqlens_cpu": OFFSETS, **kwargs}
    with pytest.raises(error) as info:
        split_packed_microbatches(**args)
    assert str(info.value) == message


def test_microbatch_seqlens_takes_one_row_and_checks_the_token_count():
    rows = split_packed_microbatches(_batch(), OFFSETS, 2).cu_seqlens
    seqlens = microbatch_seqlens(rows[1:2], 88)  # what a stage receives: a [1, W] chunk
    assert isinstance(seqlens, LayerLocalSeqlens) and seqlens.seq_lens() == [7, 21, 33, 9, 1, 17, 0]
    assert seqlens.local().cu_seqlens is not seqlens.local().cu_seqlens  # fresh per layer call
    shared = microbatch_seqlens(rows[0], 88, seqlens_class=SharedSeqlens)
    assert shared.local().cu_seqlens is shared.local().cu_seqlens
    with pytest.raises(ValueError, match=r"cu_seqlens must be one microbatch's offsets row, \[1, W\] or \[W\] \(the "
                                         r"schedule chunks the \[M, W\] offsets on dim 0\), got shape \(2, 8\)"):
        microbatch_seqlens(rows, 88)
    # a microbatch received into a buffer of another size (gloo does not check): the token count does
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\] must equal the packed token count num_tokens=103"):
        microbatch_seqlens(rows[0:1], 103)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("pp", [2, 4])
def test_stage_layout_is_torchtitans(schedule, pp):
    from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping

    torch_name = SCHEDULES[schedule].torch_class.removeprefix("Schedule")
    stages = SCHEDULES[schedule].num_stages(pp)
    for rank in range(pp):
        assert stage_indices(schedule, rank, pp) == _get_pp_rank_to_stage_indices_mapping(rank, pp, torch_name, stages)


@pytest.mark.parametrize(
    ("schedule", "pp", "microbatches", "message"),
    [
        ("1f1b", 2, 1, "microbatches (1) must be >= the number of stages (2) for schedule '1f1b' (torch's "
                       "Schedule1F1B)"),
        ("interleaved-1f1b", 2, 5, "microbatches (5) must be a multiple of the rounds of schedule 'interleaved-1f1b', "
                                   "max(1, microbatches // pp) = 2 (torch's ScheduleInterleaved1F1B)"),
        ("dualpipev", 2, 2, "microbatches (2) must be >= the number of stages (4) for schedule 'dualpipev' (torch's "
                            "ScheduleDualPipeV)"),
        ("pipedream", 2, 2, "schedule must be one of ('gpipe', '1f1b', 'interleaved-1f1b', 'interleaved-zero-bubble', "
                            "'zbv-zero-bubble', 'dualpipev'), got 'pipedream'"),
        ("gpipe", 2, 0, "microbatches must be an int >= 1, got 0"),
    ],
)
def test_microbatch_counts_torch_refuses_are_refused_first(schedule, pp, microbatches, message):
    with pytest.raises(ValueError) as info:
        check_schedule(schedule, pp=pp, microbatches=microbatches, selective_ac=False)
    assert str(info.value) == message


def test_zero_bubble_schedules_are_refused_under_selective_ac_with_torchs_reason():
    for name, info in SCHEDULES.items():
        if not info.zero_bubble:
            assert check_schedule(name, pp=2, microbatches=4, selective_ac=True) is info
            continue
        assert check_schedule(name, pp=2, microbatches=4, selective_ac=False) is info  # full AC runs them
        with pytest.raises(ValueError) as refused:
            check_schedule(name, pp=2, microbatches=4, selective_ac=True)
        text = str(refused.value)
        assert text.startswith(f"schedule '{name}' cannot run under selective AC: zero-bubble schedules split each "
                               "backward into an input pass and a weight pass")
        assert "'Trying to backward an extra time." in text and text.endswith("use ac='full' or gpipe, 1f1b, "
                                                                              "interleaved-1f1b")
    assert [n for n, i in SCHEDULES.items() if i.zero_bubble] == ["interleaved-zero-bubble", "zbv-zero-bubble",
                                                                  "dualpipev"]


def test_build_schedule_refuses_the_wrong_number_of_local_stages():
    with pytest.raises(ValueError, match=r"schedule 'interleaved-1f1b' runs 2 stage\(s\) per rank, got 1"):
        build_schedule("interleaved-1f1b", [object()], 4, lambda out, target: out.sum())


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.inner(x))


class _StageModule(nn.Module):
    """A stage's module: two checkpointed blocks."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for block in self.layers:
            x = checkpoint(block, x, use_reentrant=False)
        return x


class _FakeStage:
    """What StageRegionTags needs of a torch PipelineStage: stage_index, submod, forward_one_chunk."""

    def __init__(self, index):
        self.stage_index, self.submod = index, _StageModule()

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        return self.submod(*args)


def test_region_tags_name_stage_microbatch_and_shape_inference_pass():
    tags = StageRegionTags()
    stage = _FakeStage(3)
    handle = tags.attach(stage)
    x = torch.randn(2, 4, requires_grad=True)
    with ReplayAudit(region_tag=tags, on_divergence="record") as audit:
        stage.submod(x).sum().backward()  # as torch's shape-inference pass calls it: outside forward_one_chunk
        for mb in (0, 1):
            stage.forward_one_chunk(mb, (x,)).sum().backward()
    assert tags() is None, "no tag outside a stage's forward"
    assert [r.label for r in audit.regions] == [
        "stage 3 / shape inference: layers.0", "stage 3 / shape inference: layers.1",
        "stage 3 / mb 0: layers.0", "stage 3 / mb 0: layers.1", "stage 3 / mb 1: layers.0", "stage 3 / mb 1: layers.1",
    ]
    assert audit.recompute_counts == [1] * 6 and audit.ok
    handle.remove()
    with ReplayAudit(region_tag=tags, on_divergence="record") as audit:
        stage.forward_one_chunk(0, (x,)).sum().backward()
    assert [r.label for r in audit.regions] == ["layers.0", "layers.1"]  # untagged after remove()
    with pytest.raises(TypeError, match=r"stage must be a torch\.distributed\.pipelining PipelineStage, got int"):
        tags.attach(3)


def test_region_tag_must_be_callable_and_return_text():
    with pytest.raises(TypeError, match="region_tag must be a callable returning a str or None, got str"):
        ReplayAudit(region_tag="stage 0")
    block = _Block()
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(TypeError, match="region_tag must return a str or None, got int"), ReplayAudit(region_tag=lambda: 7):
        checkpoint(block, x, use_reentrant=False)


def test_spec_resolves_pp_defaults_and_runs_the_one_rank_reference_first():
    spec = RegressionSpec(pp=2).validate()
    assert (spec.ep, spec.steps, spec.microbatches, spec.schedule, spec.world) == (1, 2, 4, "1f1b", 2)
    assert spec.ordered_modes == (PP1_REFERENCE, "no-ac", "shared", "isolated", "global-disable")
    both = RegressionSpec(pp=2, ep=2).validate()
    assert (both.mesh.dp, both.mesh.ep, both.world) == (2, 2, 4)  # EP over the data-parallel ranks of each stage
    assert RegressionSpec().microbatches is None and RegressionSpec().ordered_modes[0] == "no-ac"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pp": 0}, "pp must be an int >= 1, got 0"),
        ({"microbatches": 4}, "microbatches is used only with pp > 1 (pipeline parallelism), got 4"),
        ({"pp": 2, "cp": 2, "hidden_size": 64, "backend": "fla"},
         "pp (2) and cp (2) > 1 together: the regression runs pipeline and context parallelism one at a time"),
        ({"pp": 2, "microbatches": 1}, "microbatches (1) must be >= the number of stages (2) for schedule '1f1b' "
                                       "(torch's Schedule1F1B)"),
        ({"pp": 2, "microbatches": 9, "schedule": "gpipe"},
         "microbatches must be <= 8 (the regression's PP batches hold 8 non-empty documents at their smallest, and "
         "documents are not split), got 9"),
        ({"pp": 4, "schedule": "interleaved-1f1b"},
         "num_layers (4) must be >= the number of pipeline stages (8: pp 4 x 2 per rank for schedule "
         "'interleaved-1f1b')"),
        ({"pp": 2, "schedule": "gpipe-ish"}, "schedule must be one of ('gpipe', '1f1b', 'interleaved-1f1b', "
                                             "'interleaved-zero-bubble', 'zbv-zero-bubble', 'dualpipev'), got "
                                             "'gpipe-ish'"),
        ({"pp": 2, "data_ranks": 2}, "data_ranks is not used with pp > 1 (each data-parallel rank trains its own "
                                     "batch), got 2"),
    ],
)
def test_spec_refuses_bad_pp_fields_naming_them(kwargs, message):
    with pytest.raises(ValueError) as info:
        RegressionSpec(**kwargs).validate()
    assert str(info.value) == message


def test_spec_refuses_zero_bubble_under_selective_ac_and_takes_it_under_full_ac():
    with pytest.raises(ValueError, match=r"^schedule 'zbv-zero-bubble' cannot run under selective AC: zero-bubble"):
        RegressionSpec(pp=2, schedule="zbv-zero-bubble").validate()
    assert RegressionSpec(pp=2, schedule="zbv-zero-bubble", ac="full").validate().world == 2
