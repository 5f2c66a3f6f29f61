"""The learner role: batches from the broker, an algorithm-blind training step (losses and advantage
estimators as pure functions), Entropulse, checkpoints that commit groups, weight rounds (docs/architecture.md)."""
