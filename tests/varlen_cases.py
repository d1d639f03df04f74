"""Varlen lengths shared by the CPU model of the backward (tests/test_runtime_dispatch.py) and the GPU
tests (tests/test_varlen_gpu.py): (lens_q, lens_k, seqused_q, seqused_k)."""

# lengths, seqused; the unused rows of q, k, v and dout NaN: sequence 0 uses all its 400 keys, and its last
# key block runs into sequence 1's unused keys (and 2's): dq of sequence 0 went NaN on the H100; sequence 2
# uses all its 129 queries and its last query block runs into sequence 3's unused ones (17 of 64 used):
# dk, dv of its one used key (row 500) went NaN. Used lengths 0 (1's queries, 3's keys: rows that see
# no key, LSE -inf), whole sequences, one row or key.
SEQUSED = ([300, 200, 129, 64, 70, 1, 517], [400, 100, 129, 70, 64, 5, 300],
           [250, 0, 129, 17, 64, 1, 300], [400, 50, 1, 0, 64, 5, 211])

# the paths a NaN past seqused had into a used row's gradient, one sequence each: 0 uses all its queries
# and keys and its last blocks run into 1's and 2's unused rows (1: 17 of 64 queries, no key; 2: no query,
# 30 of 64 keys: a CTA with no step); 3 uses all its rows and its blocks run into 4's (50 of 70 queries
# used) and past the packed tensors' end (TMA's zero fill); causal: sequence 0's first 29 queries see no
# key (LSE -inf), D and LSE of the unused rows are never read (the preprocess pads them +inf / 0)
SEQUSED_NEXT = ([129, 64, 200, 33, 70], [100, 130, 64, 300, 5], [129, 17, 0, 33, 50], [100, 0, 30, 300, 5])
