"""ReplayAudit: name the first op where a checkpointed region's recompute diverges from its forward.

Activation checkpointing reruns each checkpointed region (the *recompute*) during backward. Selective AC
(SAC) hands the recompute the outputs it saved in forward by op and invocation index (torch >= 2.13) or
from one FIFO queue per op (torch 2.11); both assume that the recompute runs the same aten ops, in the
same order, as the forward. When the region consults state that changed in between (FLA's identity-keyed
``tensor_cache``, a memoised mask builder, a global flag), the two passes differ, and SAC replays saved
tensors into the wrong ops: an error far from the cause, or silently wrong gradients.

:class:`ReplayAudit` records, for every checkpointed region, the ops of its forward and of each of its
recomputes and compares them op by op. Per recorded op it keeps the op overload (e.g.
``aten.sub.Tensor``) and, per output tensor, its shape, dtype and device, never a tensor. Ops that SAC
itself ignores (``aten.detach``, ``prim.device`` and tensor-metadata ops) are ignored here too.

While the audit is active (``with ReplayAudit(): ...``) it also runs FLA's cache probe
(:func:`~fla_ac_isolation.fla_cache.probe_tensor_cache`), and slices its hit/miss events per region and
pass, so a divergence caused by FLA names the index helper whose cache state differed, and every region
reports its cache telemetry.

How regions are found:

* ``with ReplayAudit():`` patches ``torch.utils.checkpoint``'s non-reentrant implementation for the
  duration of the block, so *every* non-reentrant checkpoint call made inside it is audited: full AC and
  SAC alike, :func:`~fla_ac_isolation.checkpoint_layers`, torch's and torchtitan's ``checkpoint_wrapper``
  (``ptd_checkpoint_wrapper``), transformers' ``gradient_checkpointing_enable(...)`` (non-reentrant) and
  plain ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. The user's own ``context_fn``
  (e.g. a SAC policy) keeps working: the audit wraps it.
* :meth:`ReplayAudit.context_fn` builds a ``context_fn`` for checkpoint calls made elsewhere, e.g.
  ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
  "context_fn": audit.context_fn(sac_context_fn(policy))})``; it works inside and outside the ``with``
  block (outside it, without FLA telemetry).

Labels: a user ``label``, else the module path of the checkpointed module, or when the checkpointed
callable is not a module, of the module calling checkpoint (``layers.0``, with
``_checkpoint_wrapped_module`` and ``_orig_mod`` dropped) inside ``model`` or, when no model was given,
inside the outermost module whose forward is running when the region starts; else ``region #i (ClassName)``
or ``region #i``.

What it sees and does not see:

* Eager regions: every aten op. Early-stopped recomputes (torch's default ``early_stop=True``) are
  compared as prefixes of their forward; regions never recomputed (no backward, or backward stopped by an
  error) are reported as such; a second recompute (``retain_graph=True``) is compared too.
* Compiled code inside a region (``torch.compile(layer, fullgraph=False)``, then checkpointed): the
  recorder, like SAC's modes, lets compiled graphs run whole (``ignore_compile_internals``), so it sees
  exactly the ops SAC sees there: the aten ops inductor's generated code still sends through the
  dispatcher (extern kernels such as ``aten.addmm.out``, fallbacks such as FLA's ``repeat_interleave``)
  and the eager ops between graphs. Ops fused into generated kernels are invisible (a layer of 54 eager
  ops records 8). FLA's ``tensor_cache`` lookup breaks the graph and runs eagerly, so the probe still
  attributes a divergence; a divergence that stays inside one fused kernel cannot be seen (nor can SAC
  misreplay it). See ``tests/test_audit_compile.py``.
* torch 2.11 (SAC replays from one FIFO queue per op) and torch >= 2.13 (by op and invocation index):
  the recorder does not depend on how SAC replays; any divergence it reports shifts both.
* Checkpoint calls traced *into* a compiled graph (``torch.compile`` around the checkpoint call) do not
  reach torch's eager checkpoint and are not audited.
* Reentrant checkpoints (``use_reentrant=True``) recompute inside autograd with no ``context_fn``: the audit
  cannot look into them. Each one that runs is reported: an :class:`UnauditedCheckpointWarning`, a row
  ``reentrant checkpoint: not audited`` in :meth:`ReplayAudit.summary`, an entry of
  :attr:`ReplayAudit.unaudited`, and the verdict ``"blind"``; never counted clean. Likewise a checkpoint in
  torch's debug mode (it takes no ``context_fn``).
* Which torch function to intercept differs between torch releases
  (:mod:`fla_ac_isolation.audit.torch_checkpoint`, which knows torch 2.11 to 2.15); on a torch whose internals
  it does not recognise, entering the audit raises :class:`UnsupportedTorchCheckpointError` (naming the torch
  version and what was not found) instead of recording nothing.

Verdict: :attr:`ReplayAudit.ok` is "no region diverged" (as before); :attr:`ReplayAudit.verdict` is
``"divergent"``, ``"aligned"`` (at least one region recomputed and compared, none diverged, none unaudited) or
``"blind"`` (nothing was judged, or some checkpointed region ran unaudited; :attr:`ReplayAudit.why_blind`
says which).

Modes (``on_divergence``):

* ``"raise"`` (default): raise :class:`ReplayDivergenceError` (from ``backward()``) at the first
  divergent op of a recompute; when the op itself differs, before it runs, so before SAC replays a wrong
  tensor or fails with its own error. The message names the region, the op index, the innermost module
  running there (``layers.0.mixer``), both ops, the FLA helpers whose cache state differed and the fix.
* ``"warn"``: emit a :class:`ReplayDivergenceWarning` with the same text once per divergent recompute
  and carry on (SAC may still fail afterwards, or silently replay wrong tensors).
* ``"record"``: stay silent; read :attr:`ReplayAudit.regions` / :meth:`ReplayAudit.summary` afterwards.
  Recording never changes results: the recorder only observes (results are bit-equal to no audit).

Overhead (measured on this project's 2-core CPU machines, torch 2.13, under load, so +-30%): about
8 to 13 microseconds per recorded aten op (one Python ``__torch_dispatch__`` call plus a tuple of output
metadata; 1000 tiny ``add`` s checkpointed: 10-24 ms -> 37-41 ms per step); on realistic steps little:
the fault stack (4 small layers, 416 recorded ops) 231 -> 242 ms (1.05x), 4 checkpointed
``[512, 1024] -> 1024 -> 1024`` MLP layers 637 -> 663 ms (1.04x), one step of the tiny ``qwen3_5_moe``
regression model (~6,300 recorded ops) about 1.03x. Memory: roughly 200 bytes per recorded op, freed
with the audit. Outside checkpointed regions nothing is recorded. A debugging tool: wrap one step.
"""

from fla_ac_isolation.audit.recorder import ReplayDivergenceError, ReplayDivergenceWarning
from fla_ac_isolation.audit.records import CacheDifference, UnauditedRegion
from fla_ac_isolation.audit.replay_audit import ReplayAudit, UnauditedCheckpointWarning
from fla_ac_isolation.audit.report import RegionReport
from fla_ac_isolation.audit.session import OnDivergence
from fla_ac_isolation.audit.torch_checkpoint import UnsupportedTorchCheckpointError

__all__ = [
    "CacheDifference",
    "OnDivergence",
    "RegionReport",
    "ReplayAudit",
    "ReplayDivergenceError",
    "ReplayDivergenceWarning",
    "UnauditedCheckpointWarning",
    "UnauditedRegion",
    "UnsupportedTorchCheckpointError",
]
