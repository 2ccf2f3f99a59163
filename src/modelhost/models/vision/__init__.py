"""Vision towers: image preprocessing and encoders of vision-language models."""
