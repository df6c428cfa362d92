"""Differences between the JAX versions automap supports (0.10 on Python 3.11, 0.11+
on Python 3.12), kept in one place."""

from __future__ import annotations


def scan_counts(params) -> tuple[int, int]:
    """(number of constants, number of carries) of a `scan` equation. JAX 0.10 records
    them as `num_consts`/`num_carry`; later versions describe the operand groups in
    `ft_in` (constants, carries, scanned inputs): a tuple of three tuples with one entry
    per flat value, or a flat-tree object whose tree has those three groups."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    ft = params["ft_in"]
    tree = getattr(ft, "tree", None)  # a flat-tree object: groups are its top children
    if tree is not None:
        consts, carry = tree.children()[:2]
        return consts.num_leaves, carry.num_leaves
    return len(ft[0]), len(ft[1])
