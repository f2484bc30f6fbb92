"""Audit a failing run and a silently wrong one with ReplayAudit; read the region, the op and the fix.

Two runs that go wrong under selective activation checkpointing (SAC), each done twice: once plainly, as
a user would meet it, and once wrapped in :class:`~fla_ac_isolation.ReplayAudit`.

1. **A crash.** The tiny Qwen3.5-MoE decoder of the EP regression (this package's Qwen3.5 GDN mixer +
   torchtitan's MoE, one process, no EP), every block checkpointed under the ``save_all_copies`` policy,
   every layer handed one shared ``cu_seqlens`` object (``SharedSeqlens``). Plainly, backward fails with
   ``RuntimeError: Autograd not support dtype: Int``, far from the cause. Under
   ``ReplayAudit(on_divergence="raise")`` it fails earlier, with a ``ReplayDivergenceError`` that names the
   block, the first op where the recompute left the forward, the FLA helper whose cache state differed,
   and the fix.
2. **Silently wrong gradients.** A 4-layer stack that calls FLA's real index helpers
   (``fla_ac_isolation.harness.fault_stack``, the project's smallest reproduction) under a policy that saves
   float ``sub`` results. Plainly, backward succeeds, the loss is the no-AC loss, and the gradients are
   wrong. ``ReplayAudit(on_divergence="record")`` lets the step finish and reports which region diverged.

Then both are fixed with ``LayerLocalSeqlens`` and audited again: every region aligned.

Run: ``python examples/audit_failure.py`` (about 10 s on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")  # FLA's notice on CPU-only machines
warnings.filterwarnings("ignore", message="In CPU autocast")  # torchtitan's MoE router asks for fp32 autocast

from fla_ac_isolation import LayerLocalSeqlens, ReplayAudit  # noqa: E402
from fla_ac_isolation.audit import ReplayDivergenceError  # noqa: E402
from fla_ac_isolation.fla_seam.cache import clear_tensor_cache  # noqa: E402
from fla_ac_isolation.harness.fault_stack import run_stack  # noqa: E402
from fla_ac_isolation.harness.modes import SharedSeqlens  # noqa: E402
from fla_ac_isolation.policies import checkpoint_layers, save_all_copies, save_ops  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=64, help="width of the Qwen3.5-MoE decoder (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------ 1. a crash
def qwen_step(args: argparse.Namespace, isolated: bool, on_divergence: str | None):
    """One forward + backward of the tiny Qwen3.5-MoE decoder under SAC.

    ``on_divergence=None`` runs it plainly; otherwise inside ``ReplayAudit(model, on_divergence=...)``.
    Returns ``(first line of the error or None, the audit or None)``.
    """
    from fla_ac_isolation.harness.regression.data import global_batch
    from fla_ac_isolation.harness.regression.expert_parallel import ensure_torch_compat, setup_torchtitan
    from fla_ac_isolation.harness.regression.model import ModelSize, build_model

    ensure_torch_compat()
    setup_torchtitan("cpu")
    size = ModelSize(args.hidden, 4, 8, 2)
    torch.manual_seed(args.seed)
    model = build_model("qwen3_5_moe", size).train()
    checkpoint_layers(model, mode="selective", policy=save_all_copies())
    batch = global_batch(0, 2, seed=args.seed, vocab_size=size.vocab_size)
    seqlens = (LayerLocalSeqlens if isolated else SharedSeqlens).from_seq_lens(list(batch.seq_lens))
    clear_tensor_cache()
    audit = ReplayAudit(model, on_divergence=on_divergence) if on_divergence else None
    try:
        with audit if audit is not None else contextlib.nullcontext():
            logits = model(batch.input_ids, seqlens)
            loss = F.cross_entropy(logits[0], batch.labels[0], ignore_index=-100)
            loss.backward()
    except Exception as err:
        text = str(err) if isinstance(err, ReplayDivergenceError) else str(err).splitlines()[0]
        return f"{type(err).__name__}: {text}", audit
    return None, audit


# ------------------------------------------------------------------------ 2. silently wrong gradients
def float_sub_policy():
    """SAC policy saving float32 ``aten.sub`` outputs (recomputing everything else)."""
    return save_ops([torch.ops.aten.sub.Tensor], dtypes=[torch.float32], name="save_float_sub")


def main(argv: list[str] | None = None) -> dict:
    """Run the four audited cases; print what a user sees and what the audit says; return the facts."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace) -> dict:
    out: dict = {}
    print("== 1. a crash: tiny Qwen3.5-MoE, SAC save_all_copies, one shared cu_seqlens for every layer")
    plain, _ = qwen_step(args, isolated=False, on_divergence=None)
    print(f"without the audit, backward raises: {plain}")
    audited, audit = qwen_step(args, isolated=False, on_divergence="raise")
    print("with ReplayAudit(on_divergence='raise'), backward raises:")
    print(audited)
    out["crash"] = {"plain_error": plain, "audited_error": audited,
                    "divergent": [(r.label, r.first_diff, r.where) for r in audit.divergent]}

    fixed, fixed_audit = qwen_step(args, isolated=True, on_divergence="raise")
    print(f"\nwith LayerLocalSeqlens: error {fixed}; regions aligned: {fixed_audit.ok}")
    print(fixed_audit.summary())
    out["crash_fixed"] = {"error": fixed, "ok": fixed_audit.ok, "regions": len(fixed_audit.regions)}

    print("\n== 2. silently wrong: FLA-helper stack, SAC saving float sub, one shared cu_seqlens")
    ref = run_stack("no-ac", None)
    plain = run_stack("shared", float_sub_policy())
    print(f"without the audit: error {plain.error}; loss {plain.loss:.6f} (no AC: {ref.loss:.6f}); "
          f"max |grad - no AC| = {plain.max_grad_diff(ref):.3g}")
    with ReplayAudit(on_divergence="record") as audit:
        audited = run_stack("shared", float_sub_policy())
    print("with ReplayAudit(on_divergence='record'):")
    print(audit.summary())
    out["silent"] = {"loss": plain.loss, "ref_loss": ref.loss, "max_grad_diff": plain.max_grad_diff(ref),
                     "audited_max_grad_diff": audited.max_grad_diff(ref),
                     "divergent": [(r.label, r.first_diff, tuple(d.helper for d in r.fla)) for r in audit.divergent]}

    with ReplayAudit(on_divergence="raise") as audit:
        fixed = run_stack("isolated", float_sub_policy())
    print(f"\nwith LayerLocalSeqlens: max |grad - no AC| = {fixed.max_grad_diff(ref):.3g}; "
          f"regions aligned: {audit.ok}")
    out["silent_fixed"] = {"max_grad_diff": fixed.max_grad_diff(ref), "ok": audit.ok}
    return out


if __name__ == "__main__":
    main()
