"""Linear algebra and Fourier transforms: batched over leading dims, whole per matrix."""

from __future__ import annotations

from .._rule import factor_rule
from ._registry import Namer, register
from ._traits import OPAQUE

#: Matrix decompositions and solves, with how many trailing dims of operand 0 make one
#: problem (the rest are batch dims every operand and result leads with).
LINALG = {
    "cholesky": 2, "cholesky_update": 2, "eig": 2, "eigh": 2, "hessenberg": 2, "householder_product": 2,
    "lu": 2, "qr": 2, "geqrf": 2, "geqp3": 2, "schur": 2, "svd": 2, "symmetric_product": 2,
    "triangular_solve": 2, "tridiagonal": 2, "lu_pivots_to_permutation": 1, "tridiagonal_solve": 1,
}


def _batched(in_shapes, out_shapes, batch: int):
    """The first `batch` dims of every value are shared, the others blocked."""
    lead = in_shapes[0][:batch]
    for s in (*in_shapes, *out_shapes):
        if tuple(s[:batch]) != tuple(lead):
            raise ValueError(f"a value of shape {s} does not lead with the batch dims {lead}")
    name = Namer()
    shared = [name(d) for d in range(batch)]
    blocked = []

    def spec(shape):
        rest = [name.fresh() for _ in shape[batch:]]
        blocked.extend(rest)
        return shared + rest

    return factor_rule([spec(s) for s in in_shapes], [spec(s) for s in out_shapes], in_shapes, out_shapes,
                       blocked=blocked)


def _def_linalg(prim: str, core: int) -> None:
    def rule(in_shapes, out_shapes, params):
        """Each matrix is solved whole (no distributed factorisation): batch dims pass
        through, the matrix dims are blocked: `([i, j, k]) -> ([i, l, m]) blocked={j, k, l, m}`."""
        return _batched(in_shapes, out_shapes, len(in_shapes[0]) - core)

    rule.__name__ = f"{prim}_rule"
    register(prim, traits=OPAQUE)(rule)  # LAPACK/cuSOLVER calls: no flops XLA counts


for _prim, _core in LINALG.items():
    _def_linalg(_prim, _core)


@register("fft", traits=OPAQUE)
def fft(in_shapes, out_shapes, params):
    """The transformed trailing dims (`fft_lengths`) are blocked, the leading ones pass
    through: a 1-D FFT is `([i, j]) -> ([i, k]) blocked={j, k}`."""
    return _batched(in_shapes, out_shapes, len(in_shapes[0]) - len(params["fft_lengths"]))
