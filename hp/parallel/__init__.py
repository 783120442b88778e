"""Applying a strategy to a model: the strategy and plan values, and every mechanism they drive.

Holds: `strategy` (`hp.Strategy`, torch-free, with its typed values
`tp2d`, `placement` and their `field_error`), `model_plan` (`hp.ModelPlan`),
`parallelize` (parameters laid out by a plan), `apply` (a strategy applied to
a plan), `data_parallel` (FSDP and the gradient reduction), `sequence`
(padding, label shift, ring order), `replicated` and `vision_batch` (whole
modules on every rank, images split with the batch), `rowwise` (norms and
RoPE on each rank's block), `hf_attention` (Ulysses around any HF
attention), `recompute`, `expert_balance`, `tp_plan` (1D, 2D or 3D TP by
bytes), `compiled` (`torch.compile` of blocks and loss), `storable`
(checkpointable fused layouts), `finetune` and `lora` (what trains).

May import: `hp.layouts`, `hp.ops`, `hp.compat` and the base modules at the
top of `hp`. Never the transforms, the zoo, `hp.train` or the CLI.
"""
