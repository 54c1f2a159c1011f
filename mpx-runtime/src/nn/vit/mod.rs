//! ViT (placeholder while building)
