"""What torch releases lack or do slowly, and the finder that lets a source tree import `hp.models`.

Holds: `backports` (DTensor view and transpose rules, FSDP's mesh dims,
installed when hp is imported), `fsdp` (FSDP2 over some axes of a laid-out
mesh, built from torch 2.11's own), `local_tensor` (shortcuts through
torch's `LocalTensor` for `hp.simulated`: metadata answered at once, no RNG
state set around ops that draw none; installed when hp is imported) and `models_finder`.

May import: `hp.layouts` and `hp.ops` (the backports lend their view rules),
the base modules at the top of `hp`, and torch. Nothing above it.
"""
