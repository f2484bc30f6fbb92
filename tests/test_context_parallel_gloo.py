"""CP=2 on two gloo ranks with FLA's own CP kernels under Triton's interpreter, against CP=1.

All cases run in ONE launch of ``tests/cp_cases.py`` (two forked ranks; see there): the Gated DeltaNet
mixers of both families in both layouts, Nemotron-H's head-parallel Mamba2, the regression's per-rank loop
on a GDN + attention decoder under CP=2 x EP=2 in every mode (with ``ReplayAudit``), and the errors that
need a real process group. Every batch has documents crossing the rank cuts, a zero-length document,
and a rank holding no document start (asserted from what the ranks report, not assumed).

Stated tolerances (float32; errors relative to ``max(1, max |reference|)``):

* mixers, CP=2 (FLA's CP kernels) vs CP=1 (pure-torch reference backend): :data:`MIXER_TOL` = 2e-5 on the
  output, the input gradient and every parameter gradient after a SUM over the CP ranks (measured: at most
  8.2e-6, the decay gradients of the GDN; outputs 7e-7). Nemotron-H head-parallel runs the same reference
  ops on whole sequences: 1e-6 (measured: output and input gradient exactly 0.0 for two B/C groups).
* decoders (regression loop): ``isolated`` equals ``no-ac`` of the same CP ranks bit for bit; ``no-ac``
  vs the one-rank run without CP within 1e-6 on the loss and 1e-4 on the full gradients relative to their
  largest (measured 2.4e-6).
"""


import pytest
from helpers import run_interpreter_cases

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MIXER_TOL = 2e-5
HEAD_PARALLEL_TOL = 1e-6
CP1_GRAD_RTOL = 1e-4
GDN_MIXERS = [f"{family}_mixer_{layout}" for family in ("qwen3_5_moe", "qwen3_8") for layout in ("contiguous", "zigzag")]
HEAD_PARALLEL = ["nemotron_h_head_parallel_contiguous", "nemotron_h_head_parallel_zigzag",
                 "nemotron_h_head_parallel_one_group"]
INT_REPLAY = "RuntimeError: Autograd not support dtype: Int"
LONG_REPLAY = "RuntimeError: Autograd not support dtype: Long"


@pytest.fixture(scope="module")
def cases():
    return run_interpreter_cases("cp_cases.py", timeout_s=900)


@pytest.mark.parametrize("case", GDN_MIXERS + HEAD_PARALLEL)
def test_every_batch_has_crossing_documents_and_a_rank_without_a_document_start(cases, case):
    result = cases[case]
    contiguous = "contiguous" in case
    # rank 0 holds tokens 0..63 (contiguous) or 0..31 and 96..127 (zigzag) of [10, 0, 30, 88] / [10, 0, 20, 70, 28]
    assert result["local_cu_seqlens"] == ([[0, 10, 40, 64], [0, 64]] if contiguous
                                          else [[0, 10, 30, 32, 36, 64], [0, 32, 64]])
    assert result["doc_start"] == [True, False], "rank 1 holds no document start"


@pytest.mark.parametrize("case", GDN_MIXERS)
def test_gdn_mixer_under_cp2_equals_cp1(cases, case):
    result = cases[case]
    assert result["output"] <= MIXER_TOL, result
    assert result["dx"] <= MIXER_TOL, result
    assert set(result["grads"]) == {"conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight",
                                    "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"}
    for name, err in result["grads"].items():
        assert err <= MIXER_TOL, (name, err)


@pytest.mark.parametrize("case", GDN_MIXERS + HEAD_PARALLEL)
def test_conv_weight_gradient_is_complete_only_after_the_sum_over_cp_ranks(cases, case):
    """FLA leaves the conv's weight gradient per rank: without the caller's SUM it is far off CP=1."""
    result = cases[case]
    assert result["conv1d.weight_without_sum"] > 0.1, result
    assert result["grads"]["conv1d.weight"] <= MIXER_TOL


@pytest.mark.parametrize("case", HEAD_PARALLEL)
def test_nemotron_h_head_parallel_equals_cp1(cases, case):
    result = cases[case]
    assert result["output"] <= HEAD_PARALLEL_TOL and result["dx"] <= HEAD_PARALLEL_TOL, result
    assert set(result["grads"]) == {"in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                                    "norm.weight", "out_proj.weight"}
    for name, err in result["grads"].items():
        assert err <= HEAD_PARALLEL_TOL, (name, err)


@pytest.mark.parametrize("case", ["qwen3_5_moe_decoder_zigzag", "qwen3_8_decoder_contiguous"])
def test_cp2_x_ep2_no_ac_matches_the_run_without_cp_and_isolated_is_bit_exact(cases, case):
    result = cases[case]
    cp1, no_ac, isolated = result["no-ac-cp1"], result["no-ac"], result["isolated"]
    assert abs(no_ac["losses"][0] - cp1["losses"][0]) <= 1e-6 * abs(cp1["losses"][0])
    assert no_ac["cp1_grad_diffs"][0] <= CP1_GRAD_RTOL * no_ac["cp1_ref_grad_max"][0], no_ac
    assert isolated["losses"] == no_ac["losses"]
    assert isolated["grad_diffs"] == [0.0], "every gradient on every rank, bit for bit"
    assert isolated["audit"] == {"ok": True, "regions": 2}, "both checkpointed blocks recomputed the forward's ops"


@pytest.mark.parametrize("case", ["qwen3_5_moe_decoder_zigzag", "qwen3_8_decoder_contiguous"])
def test_field_mode_reproduces_the_fault_under_save_all_copies(cases, case):
    """Each layer builds FLA's CP context from the one shared cu_seqlens: block 0 misses FLA's cache in its
    forward and hits in its recompute, 6 ops in; SAC hands a later cast FLA's int64 offsets."""
    field = cases[case]["field"]
    assert field["errors"] == [LONG_REPLAY, LONG_REPLAY], "both ranks fail, at the same op"
    assert field["audit"] == {
        "ok": False, "label": "layers.0", "first_diff": 6,
        "fla": ["get_cp_cu_seqlens miss->hit", "prepare_chunk_indices miss->hit", "prepare_chunk_offsets miss->hit"],
    }


def test_one_shared_cp_context_is_unsafe_too(cases):
    """A context built once per batch but handed to every layer as is: FLA's kernels still look up
    prepare_chunk_indices/prepare_chunk_offsets on its cu_seqlens, miss in block 0's forward, hit in its
    recompute (24 ops in, the conv's schedule)."""
    shared = cases["qwen3_5_moe_decoder_zigzag"]["shared"]
    assert shared["errors"] == [INT_REPLAY, INT_REPLAY]
    assert shared["audit"] == {"ok": False, "label": "layers.0", "first_diff": 24,
                               "fla": ["prepare_chunk_indices miss->hit", "prepare_chunk_offsets miss->hit"]}


def test_cp_config_checks_the_process_group(cases):
    assert cases["errors"]["group_size"] == (
        "CPConfig.world_size=3 differs from the size of CPConfig.group (2 ranks); leave world_size=None to read "
        "it from the group"
    )
    assert cases["errors"]["rank"] == "CPConfig.rank=1 differs from this process's rank in CPConfig.group (0)"

