"""The codec's CPU path compiled with numba: the loops that numpy and torch can only run as many
small passes, each one compiled pass here, with the same bytes in and the same tensors out.

* `codec.native.index_decode` — the index decoder's walk over a chunk group (the numpy walk in
  `codec.index_decode` is its reference);
* `codec.native.scatter` — dequantisation fused with the scatter-add of an update into a dense
  float32 tensor (aggregation, densify, the error-feedback write-back on the CPU).
* `codec.native.rows` — the check that every index row lies inside its chunk and ascends
  strictly (`codec.compress.SparseTensor.validate` on the CPU).

Compiled functions are cached on disk (numba's ``cache=True``: next to the sources, or in the
user's cache directory where those are read-only), so a process pays the compile once;
``python -m codec.native`` (run by `scripts/setup.sh`) compiles them before many processes start.
"""
