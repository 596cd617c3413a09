"""llama.cpp's GGUF files as a `ModelSource` (DESIGN §6: GGUF).

  file.py       the container: metadata key/values and the tensor directory, from an mmap
  config.py     the metadata as the config.json it stands for (field_table.GGUF)
  archs.py      what each architecture (qwen2, qwen3, qwen3moe, phi3, gemma2, gemma3) adds
  shapes.py     its counts and sizes checked against the tensor directory
  quants.py     ggml's block formats dequantized to BF16
  tokenizer.py  a `tokenizers.Tokenizer` from tokenizer.ggml.*
  source.py     `GGUFSource`, tying them together (formats/source.py opens it for a .gguf)
"""
