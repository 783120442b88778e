"""hp.models: the reference model zoo (plans for HF Llama, Qwen-MoE, Qwen-VL).

Installed as the subpackage `hp.models`; the plans land with the issues that
build them.
"""
