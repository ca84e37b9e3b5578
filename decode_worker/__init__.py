"""The decode role: reserve pages, receive pushed KV into them, decode in continuous batches."""
