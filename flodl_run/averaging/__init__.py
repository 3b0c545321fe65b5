"""Parameter averaging: flat parameter storage, the collective consensus, and its math."""
