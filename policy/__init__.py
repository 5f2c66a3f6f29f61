"""The model side the actor and the learner share: the policy model and its log-probs (``model.py``), tokenizers
and chat templates (``tokenizer.py``), a VLM's image inputs (``vision.py``), and weight rounds from the learner to
the engines (``weightsync.py``, with CUDA IPC handles in ``cuda_ipc.py``). torch and transformers are imported
where they are used, so a process that only reads a config does not pay for them."""
