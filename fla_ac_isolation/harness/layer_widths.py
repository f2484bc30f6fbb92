"""The benchmarks' layer widths: which family's mixer runs a kind of layer (Gated DeltaNet or Mamba2) and its
transformers config fields at a model width."""

from __future__ import annotations

from fla_ac_isolation.families import FAMILIES, Family

__all__ = ["LAYERS", "family_for_layer", "layer_fields"]

LAYERS: tuple[str, ...] = ("gdn", "mamba2")
"""The kinds of FLA-backed mixer a family's layers run: Gated DeltaNet, or Mamba2 (FLA's simple GLA as its SSD)."""


def layer_fields(layer: str, hidden: int) -> dict[str, int]:
    """transformers config fields of a ``layer`` mixer at model width ``hidden`` (``D``), as the benchmarks run it.

    GDN: ``K = V = min(128, D // 4)``, ``D // K`` heads. Mamba2: ``P = min(64, D // 4)``, ``H = 2 * D // P`` heads,
    ``G = min(8, H)`` groups, state ``N = min(128, D)``.

    Raises:
        ValueError: ``hidden`` does not split into whole heads, or ``layer`` is not one of :data:`LAYERS`.
    """
    if layer not in LAYERS:
        raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")
    if hidden < 16 or hidden % 4:
        raise ValueError(f"--hidden must be a multiple of 4 and at least 16, got {hidden}")
    if layer == "gdn":
        head_dim = min(128, hidden // 4)
        if hidden % head_dim:
            raise ValueError(f"--hidden {hidden} does not split into GDN heads of {head_dim}")
        heads = hidden // head_dim
        return dict(
            hidden_size=hidden, linear_num_key_heads=heads, linear_num_value_heads=heads,
            linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_conv_kernel_dim=4,
        )
    head_dim = min(64, hidden // 4)
    if (2 * hidden) % head_dim:
        raise ValueError(f"--hidden {hidden} does not split into Mamba2 heads of {head_dim}")
    heads = 2 * hidden // head_dim
    groups = min(8, heads)
    if heads % groups:
        raise ValueError(f"--hidden {hidden} gives {heads} Mamba2 heads, not a multiple of {groups} groups")
    return dict(
        hidden_size=hidden, mamba_num_heads=heads, mamba_head_dim=head_dim, ssm_state_size=min(128, hidden),
        n_groups=groups, conv_kernel=4, expand=2, chunk_size=64,
    )


def family_for_layer(layer: str) -> Family:
    """The first family (registry order) whose mixer is a ``layer`` (:data:`LAYERS`).

    Raises:
        ValueError: ``layer`` is not one of :data:`LAYERS`.
    """
    if layer not in LAYERS:
        raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")
    return next(family for family in FAMILIES.values() if family.layer == layer)
