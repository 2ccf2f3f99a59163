"""Pulling models from the Hugging Face hub into its shared cache (`modelhost pull`, Ollama's
`/api/pull`, the console): which files a reference means, the checks made before any weight
is fetched, and the download itself."""
