"""Tensor parallelism: process groups, the executor over ranks, Ray placement of ranks and the step wire."""
