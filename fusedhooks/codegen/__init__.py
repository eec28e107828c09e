"""A plan to Triton source and its launch spec: expression rules (`emit`), kernel writers, the launch spec, and the
generated-source cache."""
