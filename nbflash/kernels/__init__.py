"""Device code only: one module per kernel family, each with a cached ``build_...(config)`` factory."""
