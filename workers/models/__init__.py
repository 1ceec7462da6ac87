"""Shipped model directories and the recipe that trained them."""
