"""`hp train CONFIG.yaml`: LlamaFactory-style training of the model zoo, configured by one YAML file."""
