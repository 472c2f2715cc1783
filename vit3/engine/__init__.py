"""vit3.engine"""
