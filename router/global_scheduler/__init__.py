"""The global scheduler: every worker's KV blocks and load, the ranking, predictions, its feed, mirrors and actor."""
