//! GBNF (llama.cpp's grammar format, the one SGLang's `ebnf` field takes
//! through xgrammar) translated to the Lark dialect llguidance reads.
//!
//! The two differ in a few spellings only: a rule is `name ::= ...` (Lark:
//! `name: ...`), the start rule is `root` (Lark: `start`), a character class
//! is a bare `[a-z]` (in Lark that means "optional": it becomes the regex
//! `/[a-z]/`), `.` is any character, and a rule may continue on the next
//! lines (Lark ends a rule at a newline: each rule becomes one line). Rule
//! names get a `g_` prefix and are lowercased, since Lark reads names
//! starting upper-case as terminals. Strings, grouping, `|`, `*`, `+`, `?`,
//! `{m,n}` and `#` comments read the same.

/// Lark for the GBNF grammar `g`, or what is wrong with it.
pub fn to_lark(g: &str) -> Result<String, String> {
    let chars: Vec<char> = g.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    let mut rules = 0;
    let mut has_root = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '"' => {
                let end = quoted_end(&chars, i, '"')
                    .ok_or_else(|| format!("unterminated string at character {i}"))?;
                out.extend(&chars[i..=end]);
                i = end + 1;
            }
            '[' => {
                let end = quoted_end(&chars, i, ']')
                    .ok_or_else(|| format!("unterminated character class at character {i}"))?;
                out.push('/');
                for &ch in &chars[i..=end] {
                    if ch == '/' {
                        out.push('\\');
                    }
                    out.push(ch);
                }
                out.push('/');
                i = end + 1;
            }
            '.' => {
                out.push_str("/(?s:.)/");
                i += 1;
            }
            c if c.is_ascii_alphanumeric() || c == '_' || c == '-' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == '-')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let mut j = i;
                while j < chars.len() && chars[j].is_whitespace() {
                    j += 1;
                }
                let defines = chars[j..].starts_with(&[':', ':', '=']);
                if word.chars().all(|c| c.is_ascii_digit()) && !defines {
                    // A repetition count (`{2,5}`).
                    out.push_str(&word);
                    continue;
                }
                if defines {
                    has_root |= word == "root";
                    if rules > 0 {
                        out.push('\n');
                    }
                    rules += 1;
                    out.push_str(&rule_name(&word));
                    out.push(':');
                    i = j + 3;
                } else {
                    out.push_str(&rule_name(&word));
                }
            }
            c if c.is_whitespace() => {
                out.push(' ');
                i += 1;
            }
            '(' | ')' | '|' | '*' | '+' | '?' | '{' | '}' | ',' => {
                out.push(c);
                i += 1;
            }
            other => return Err(format!("unexpected `{other}` at character {i}")),
        }
    }
    if !has_root {
        return Err("a GBNF grammar needs a `root` rule".into());
    }
    Ok(format!("start: {}\n{out}\n", rule_name("root")))
}

fn rule_name(gbnf: &str) -> String {
    format!("g_{}", gbnf.to_ascii_lowercase())
}

/// Index of the `close` that ends the literal opened at `open` (a
/// backslash escapes the next character).
fn quoted_end(chars: &[char], open: usize, close: char) -> Option<usize> {
    let mut i = open + 1;
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 2,
            c if c == close => return Some(i),
            _ => i += 1,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gbnf_rules_classes_and_comments_become_lark() {
        let g = "# yes or no\nroot ::= answer \" \" [0-9]+ \n answer ::= \"yes\" | \"no\" # the choice\nSlash-Rule ::= [/a] . x{2,3}";
        let lark = to_lark(g).unwrap();
        assert_eq!(
            lark,
            "start: g_root\n g_root: g_answer \" \" /[0-9]/+   \ng_answer: \"yes\" | \"no\"  \ng_slash-rule: /[\\/a]/ /(?s:.)/ g_x{2,3}\n"
        );
        assert_eq!(
            to_lark("answer ::= \"a\"").unwrap_err(),
            "a GBNF grammar needs a `root` rule"
        );
        assert!(to_lark("root ::= \"a")
            .unwrap_err()
            .contains("unterminated string"));
        assert!(to_lark("root ::= [a")
            .unwrap_err()
            .contains("character class"));
        assert!(to_lark("root ::= \"a\" ;").unwrap_err().contains("`;`"));
    }
}
