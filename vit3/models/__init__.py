"""vit3.models"""
