//! `[data]`'s image transforms: the named normalisations and `[data.augment]`.
use serde::{Deserialize, Serialize};

/// `data.normalize`: the mean and std a family of pretrained models was trained with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Normalize {
    /// torchvision's ImageNet models (and timm's, most of them).
    Imagenet,
    /// OpenAI's CLIP (Hugging Face `CLIPImageProcessor`, open_clip).
    Clip,
}

impl Normalize {
    /// (mean, std) per RGB channel.
    pub fn constants(self) -> ([f64; 3], [f64; 3]) {
        match self {
            Normalize::Imagenet => ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
            Normalize::Clip => (
                [0.48145466, 0.4578275, 0.40821073],
                [0.26862954, 0.26130258, 0.27577711],
            ),
        }
    }
}

/// `[data.augment]`: torchvision's RandomResizedCrop, ColorJitter, RandomCrop(size, padding)
/// and RandomHorizontalFlip(0.5), in that order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Augment {
    /// Pixels of padding on each side before a random crop back to the image size; 0: no crop.
    pub crop_padding: i64,
    pub horizontal_flip: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub random_resized_crop: Option<ResizedCrop>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub color_jitter: Option<ColorJitter>,
}

impl Augment {
    pub fn enabled(&self) -> bool {
        self.crop_padding > 0
            || self.horizontal_flip
            || self.random_resized_crop.is_some()
            || self.color_jitter.is_some()
    }
}

/// `data.augment.random_resized_crop`: a box of a random share of the area (`scale`) and
/// aspect ratio (`ratio`, drawn on a log scale), resized back to the image's size.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResizedCrop {
    pub scale: [f64; 2],
    pub ratio: [f64; 2],
}

impl Default for ResizedCrop {
    fn default() -> Self {
        ResizedCrop {
            scale: [0.08, 1.0],
            ratio: [3.0 / 4.0, 4.0 / 3.0],
        }
    }
}

/// `data.augment.color_jitter`: each factor a number (a spread around no change) or a
/// `[min, max]` range, as torchvision's ColorJitter takes them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ColorJitter {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub brightness: Option<Spread>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub contrast: Option<Spread>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saturation: Option<Spread>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hue: Option<Spread>,
}

/// A jitter factor: `x` (the range `[center - x, center + x]`) or `[min, max]`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Spread {
    By(f64),
    Range([f64; 2]),
}

impl Spread {
    /// The range it draws from around `center` (brightness, contrast and saturation: 1, their
    /// lower end at least 0; hue: 0).
    pub fn range(self, center: f64) -> [f64; 2] {
        match self {
            Spread::By(x) if center > 0.0 => [(center - x).max(0.0), center + x],
            Spread::By(x) => [center - x, center + x],
            Spread::Range(r) => r,
        }
    }
}
