"""The actor role: plays ticketed tasks on env_server desktops with an inference engine (hf or vllm), sends
token-in/token-out trajectory groups to the broker, and takes new weights in weight rounds
(docs/architecture.md)."""
