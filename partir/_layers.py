"""The layers of a lifted program: which inputs belong to which of its alike layers.

A train step over L structurally identical layers takes them as a sequence (a list or
tuple) of alike pytrees in its arguments: `params['layers']`, and the same sequence in
the optimizer state. `lift` keeps what it traced (`Program.origin`), so the layers are
read from the arguments' structure: an input whose pytree path passes through such a
sequence belongs to the layer its index there names. The search's shallow twins and
the rematerialization blocks are built on this.
"""

from __future__ import annotations

import jax


def alike(seq) -> bool:
    """Are the elements of `seq` pytrees of one structure, shapes and dtypes?"""
    def sig(e):
        leaves, tree = jax.tree.flatten(e)
        return tree, tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x)))) for x in leaves)

    first = sig(seq[0])
    return bool(first[1]) and all(sig(e) == first for e in seq[1:])


def children(tree):
    """(rebuild, children) of a pytree node (a dict, list, named tuple, equinox module,
    any registered node); None for a leaf."""
    kids, node = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)
    if jax.tree_util.treedef_is_leaf(node) and tree is not None:
        return None
    return node.unflatten, kids


def is_layers(tree, min_layers: int) -> bool:
    """Is `tree` a list or tuple of at least `min_layers` alike elements?"""
    return type(tree) in (list, tuple) and len(tree) >= min_layers and alike(tree)


def child(node, key):
    """The child of `node` at path entry `key`, or None where it cannot be told (then no
    layers below it are looked for: the names keep their indices)."""
    if type(node) in (list, tuple) and isinstance(key, jax.tree_util.SequenceKey):
        return node[key.idx]
    if isinstance(key, jax.tree_util.DictKey):
        try:
            return node[key.key]
        except (KeyError, TypeError, IndexError):
            return None
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name, None)
    return None


def layer_keys(prog, min_layers: int) -> dict[int, tuple] | None:
    """For each input: (argument name, pytree path, position in the path of the index
    into the outermost sequence of at least `min_layers` alike layers, or None); None if
    the program has no origin or its inputs do not match the arguments."""
    origin = prog.origin
    if origin is None:
        return None
    dyn = tuple(a for i, a in enumerate(origin.args) if i not in origin.static_argnums)
    leaves = jax.tree_util.tree_flatten_with_path(dyn)[0]
    if len(leaves) != len(prog.inputs):
        return None
    paths = [path for path, _ in leaves]
    return {v: (name[:len(name) - len(jax.tree_util.keystr(path[1:]))], path, at)
            for v, name, path, at in zip(prog.inputs, prog.input_names, paths, layer_positions(dyn, paths, min_layers))}


def layer_positions(tree, paths, min_layers: int) -> list:
    """Per leaf path of `tree`: the position in it of the index into the outermost
    sequence of at least `min_layers` alike layers, or None."""
    seen: dict[int, bool] = {}  # by node identity: a sequence is looked at once, not once per leaf
    out = []
    for path in paths:
        node, at = tree, None
        for j, k in enumerate(path):
            if at is None and type(node) in (list, tuple):
                if id(node) not in seen:
                    seen[id(node)] = is_layers(node, min_layers)
                at = j if seen[id(node)] else None
            node = child(node, k)
        out.append(at)
    return out


def input_layers(prog, min_layers: int = 2) -> dict[int, int]:
    """Input value id -> the index of the layer it belongs to (inputs outside every
    sequence of alike layers are left out)."""
    keys = layer_keys(prog, min_layers) or {}
    return {v: path[at].idx for v, (_, path, at) in keys.items() if at is not None}


def weight_derived(program, backward) -> list[bool]:
    """Per value: is it made from layer parameters and constants alone (a weight, its
    cast, a bias broadcast, a causal mask), off the activations' paths?"""
    inputs = program.input_set
    derived = [program.producer[v] < 0 and v not in inputs for v in range(len(program.values))]  # literals
    for v in input_layers(program):
        derived[v] = True
    for op in program.ops:
        if backward[op.id]:
            continue
        if all(u < 0 or derived[u] for u in op.operands):  # iotas and constants too
            for r in op.results:
                if r >= 0:
                    derived[r] = True
    return derived
