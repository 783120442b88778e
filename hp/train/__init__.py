"""`hp train CONFIG.yaml`: LlamaFactory-style training of the model zoo, configured by one YAML file.

Its parts, from the bottom up:

    config                       the YAML file, checked whole before any worker starts (torch-free)
    data                         datasets tokenized as LlamaFactory's stages do, the tokenizers, batches
    finetuning, expert_weights   LoRA and freezing applied to a model; experts stored one by one, read packed
    checkpoint, model            what a run saves and resumes; the model it starts from, laid out
    preference, objectives       the losses of the stages (language modelling, reward, DPO, KTO)
    errors, report, loader       how a run ends; metrics and TensorBoard; batches collated ahead
    preflight, loop, export      the checks before launch; the loop one worker runs; a checkpoint as HF files
    worker, zygote, stand_in     one launched worker; the warm process that forks a node's workers, and the
                                 process the elastic agent watches in each one's place
    launch                       the launcher

What it may import: all of hp below it (the zoo, the transforms, the
parallel layer, the device), never the CLI. Inside it, `config` imports
nothing else of hp.train and `data` only `config`; the modules above build
on both, and nothing imports back up.
"""
