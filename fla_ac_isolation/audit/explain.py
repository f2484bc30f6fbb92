"""The text of a divergence: what differed, why (FLA's cache, or other state), and the fix."""

from __future__ import annotations

from torch import nn

from fla_ac_isolation.audit.records import CacheDifference
from fla_ac_isolation.foreign_classes import LeakingMixer, UpstreamMixer, drop_in_name, foreign_mixer, remedy

__all__ = ["AUTOCAST_FIX", "autocast_skipped_cast", "explain", "foreign_fix"]


VERBS = {"miss": "missed", "hit": "hit", "bypass": "bypassed the cache", "not called": "was not called"}


def foreign_fix(running: list[nn.Module]) -> str | None:
    """The fix for the innermost module of ``running`` that is a known FLA-backed foreign class, or ``None``."""
    for module in running:
        found = foreign_mixer(module)
        if found is None:
            continue
        entry = found[0]
        if isinstance(entry, LeakingMixer):
            return f"{entry.name} ({entry.framework}) drops the packed offsets: {remedy(entry)}."
        if isinstance(entry, UpstreamMixer) and entry.offsets:
            swap = " (or swap_mixers(model), which replaces it with a drop-in)" if drop_in_name(entry) else ""
            return (f"{entry.name} ({entry.framework}) is code you do not own: call isolate_seqlens(model) once after "
                    f"building the model{swap}; it gives every {entry.name} call fresh {', '.join(entry.offsets)}.")
    return None


AUTOCAST_CAUSE = (
    "torch.autocast's weight-cast cache was on in this recompute and the divergent op is a cast (aten._to_copy): "
    "a weight the forward cast was still in that cache when the backward, run inside the same autocast block, "
    "recomputed the region, so the recompute skipped the cast (torch issue #193338; any checkpointed layer, FLA "
    "or not)."
)
AUTOCAST_FIX = (
    "Fix: checkpoint with context_fn=fla_ac_isolation.policies.sac_context_fn(policy) (or checkpoint_layers), "
    "which turns that cache off inside each region, instead of torch's create_selective_checkpoint_contexts "
    "alone; or call backward() outside the autocast block; or torch.autocast(..., cache_enabled=False)."
)


def autocast_skipped_cast(fwd_op: str | None, rec_op: str | None, autocast_cache: bool) -> bool:
    """Whether the divergence is autocast's weight-cast cache: the cache was on and one of the ops is a cast."""
    return autocast_cache and "aten._to_copy" in f"{fwd_op} {rec_op}"


def explain(label: str, where: str | None, idx: int, fwd_op: str, rec_op: str, diffs: list[CacheDifference],
            fix: str | None = None, autocast_cache: bool = False) -> str:
    """The message of a divergent recompute of region ``label`` at op ``idx``; ``diffs``: the FLA cache
    differences that implicate FLA (empty: not FLA); ``fix``: :func:`foreign_fix`'s, replacing the default."""
    inside = f" (in {where})" if where and where != label else ""
    lines = [f"ReplayAudit: region {label}: recompute op #{idx}{inside} is {rec_op}, forward had {fwd_op}."]
    main = [d for d in diffs if "not called" not in (d.forward, d.recompute)] or diffs
    if main:  # FLA's cache first: an autocast cause (below) can add to it
        groups: dict[tuple[str, str], list[str]] = {}
        for d in main:
            groups.setdefault((d.forward, d.recompute), []).append(d.helper)
        for (f, r), helpers in groups.items():
            lines.append(
                f"FLA {', '.join(helpers)} {VERBS[f]} in forward and {VERBS[r]} in recompute."
            )
        if any(d.forward == "miss" and d.recompute == "hit" for d in main):
            lines.append(
                "The cu_seqlens object this region passed to FLA was already in FLA's tensor_cache when the "
                "recompute ran, because it is shared with other layers."
            )
        if any(d.forward == "hit" and d.recompute == "miss" for d in main):
            lines.append(
                "An entry this region hit in forward was evicted from FLA's tensor_cache before its "
                "recompute (other calls in between filled the queue)."
            )
        lines.append(
            f"Fix: {fix}" if fix else
            "Fix: give each layer its own cu_seqlens (build a LayerLocalSeqlens once per forward and call "
            ".local() inside each layer's forward), or disable FLA's cache (tensor_cache_disabled())."
        )
    if autocast_skipped_cast(fwd_op, rec_op, autocast_cache):
        lines += [AUTOCAST_CAUSE, AUTOCAST_FIX]
    elif not main:
        lines.append(
            "Something inside the region reads state that changed between forward and backward (a cache "
            "keyed by object identity, a "
            "memoised mask or index builder, a global flag or counter, data-dependent control flow)."
        )
        lines.append(
            "Fix: make the checkpointed region a pure function of its inputs: build that state outside the "
            "region and pass it in, or build it fresh inside the region on every call."
        )
    lines.append(
        "Under selective AC the saved outputs after this point are replayed into the wrong ops (an error "
        "later in backward, or silently wrong gradients); under full AC nothing is replayed by index, so the "
        "gradients are right unless the recompute computed other values (compare them with a step without AC: "
        "fla-ac-isolation check --ac full)."
    )
    return "\n".join(lines)

