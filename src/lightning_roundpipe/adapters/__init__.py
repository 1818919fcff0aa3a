"""Turn models into layer sequences: nn.Sequential, stacks of blocks, Hugging Face causal LMs, peft."""
