"""The tolerance a quantised KV format's native decode is held to, shared by the attention tests.

Where the native build has AVX-512 VNNI, the decode of the integer formats (int8, int8-token, int8-hadamard,
int4, int4-hadamard) scores keys and sums values with integer dot products: the query and the attention
weights are quantised to 15 bits, so the output is within about 1e-3 of dense attention over the stored rows
(tests/runtime/test_kv_fused_decode.py pins 1e-3 on its data, and the float kernels' exactness beside it), not
within float rounding: the multi-step attention tests measured up to 1.3e-3 at softmax scale 1.1 (sharper
scores magnify the query's rounding), so they hold the integer path to 2e-3. Everywhere else (torch path,
float kernels, fp8 formats, prefill) the caller's exact bound holds.
"""

from __future__ import annotations

INT_DOT_TOL = 2e-3


def decode_tol(backend: str, kv_dtype: str, exact: float) -> float:
    if backend != "native" or not kv_dtype.startswith("int"):
        return exact
    from kvledger.runtime import native

    return max(exact, INT_DOT_TOL) if native.require().int_dot(-1) else exact
