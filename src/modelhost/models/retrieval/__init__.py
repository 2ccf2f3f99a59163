"""Decoders that embed (last-token pooling) or rerank (the next-token odds of yes against
no): what their files say of them, and one forward of whole prompts that serves both."""
