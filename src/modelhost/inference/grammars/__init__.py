"""What the sampler is held to: request grammars compiled for one model, tool choices as
grammars."""
