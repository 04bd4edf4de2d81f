"""Training continuous-depth Transformers with Optax."""
