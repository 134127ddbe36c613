"""Where the vectors are searched: FAISS in this process (index kinds chosen by measurement) or Milvus."""
