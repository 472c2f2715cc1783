"""vit3.data"""
