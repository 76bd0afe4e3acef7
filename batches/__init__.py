"""OpenAI's Files and Batch APIs: a tenant's uploaded files, and batches of requests run
from them in the background at the batch price (docs/batches.md)."""
