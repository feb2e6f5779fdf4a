"""Parallel plans for a site's local world: small functions applied to a plain model."""
