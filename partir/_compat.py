"""Differences between the JAX versions automap supports (0.10 on Python 3.11, 0.11+
on Python 3.12), kept in one place."""

from __future__ import annotations


def scan_counts(params) -> tuple[int, int]:
    """(number of constants, number of carries) of a `scan` equation. JAX 0.10 records
    them as `num_consts`/`num_carry`; later versions describe the operand groups in
    `ft_in` (constants, carries, scanned inputs): a flat tree of three groups, either a
    tuple of groups (whose len() counts their flat values) or a pytree of them."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    ft = params["ft_in"]
    groups = getattr(ft, "elts", None)  # a tuple of flat trees; len() counts flat values
    if groups is not None:
        return len(groups[0]), len(groups[1])
    if isinstance(ft, tuple):
        return len(ft[0]), len(ft[1])
    consts, carry = ft.tree.children()[:2]  # a pytree-shaped flat tree
    return consts.num_leaves, carry.num_leaves
