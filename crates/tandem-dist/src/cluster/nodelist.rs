//! Slurm's compressed host lists: `node[01-03,7],gpu5` is node01, node02, node03, node7, gpu5.

/// The most hosts one list may expand to; a typo like `n[0-999999999]` must not exhaust memory.
pub const MAX_HOSTS: usize = 100_000;

/// Expands a Slurm host list. Brackets hold comma-separated numbers and `low-high` ranges;
/// a range keeps the zero padding of its low end; several bracket groups in one name expand
/// to every combination, in order.
pub fn expand_slurm_nodelist(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for item in split_top_level(list)? {
        if item.is_empty() {
            return Err(format!("empty host name in {list:?}"));
        }
        expand_item(item, &mut hosts)?;
    }
    if hosts.is_empty() {
        return Err("the host list is empty".into());
    }
    Ok(hosts)
}

/// Splits at commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let mut items = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (position, character) in list.char_indices() {
        match character {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(format!("nested '[' at byte {position} of {list:?}")),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(format!("unmatched ']' at byte {position} of {list:?}")),
            ',' if depth == 0 => {
                items.push(list.get(start..position).unwrap_or_default());
                start = position + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("unclosed '[' in {list:?}"));
    }
    items.push(list.get(start..).unwrap_or_default());
    Ok(items)
}

/// Expands one name with zero or more bracket groups, appending to `hosts`.
fn expand_item(item: &str, hosts: &mut Vec<String>) -> Result<(), String> {
    let Some(open) = item.find('[') else {
        if hosts.len() >= MAX_HOSTS {
            return Err(format!(
                "the host list expands to more than {MAX_HOSTS} hosts"
            ));
        }
        hosts.push(item.to_string());
        return Ok(());
    };
    let close = item[open..]
        .find(']')
        .map(|offset| open + offset)
        .ok_or_else(|| format!("unclosed '[' in {item:?}"))?;
    let prefix = &item[..open];
    let inside = &item[open + 1..close];
    let suffix = &item[close + 1..];
    for number in expand_ranges(inside, item)? {
        expand_item(&format!("{prefix}{number}{suffix}"), hosts)?;
    }
    Ok(())
}

/// The numbers of one bracket group, as text with their padding.
fn expand_ranges(inside: &str, item: &str) -> Result<Vec<String>, String> {
    let mut numbers = Vec::new();
    for part in inside.split(',') {
        let (low, high) = part.split_once('-').unwrap_or((part, part));
        let parse = |text: &str| {
            if text.is_empty() || !text.bytes().all(|byte| byte.is_ascii_digit()) {
                return Err(format!(
                    "{part:?} in {item:?} is not a number or a range of numbers"
                ));
            }
            text.parse::<u64>()
                .map_err(|_| format!("{text:?} in {item:?} is too large"))
        };
        let (first, last) = (parse(low)?, parse(high)?);
        if first > last {
            return Err(format!("range {part:?} in {item:?} runs backwards"));
        }
        if last - first >= MAX_HOSTS as u64 || numbers.len() + (last - first) as usize >= MAX_HOSTS
        {
            return Err(format!(
                "the host list expands to more than {MAX_HOSTS} hosts"
            ));
        }
        let width = low.len();
        numbers.extend((first..=last).map(|number| format!("{number:0width$}")));
    }
    Ok(numbers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_lists_padding_and_plain_names() {
        assert_eq!(
            expand_slurm_nodelist("node[01-03,7],gpu5").expect("valid"),
            vec!["node01", "node02", "node03", "node7", "gpu5"]
        );
        assert_eq!(expand_slurm_nodelist("a").expect("valid"), vec!["a"]);
        assert_eq!(
            expand_slurm_nodelist("n[8-11]").expect("valid"),
            vec!["n8", "n9", "n10", "n11"]
        );
        assert_eq!(
            expand_slurm_nodelist("n[098-100]").expect("valid"),
            vec!["n098", "n099", "n100"]
        );
        assert_eq!(
            expand_slurm_nodelist("rack[1-2]-n[1,3].ib").expect("valid"),
            vec!["rack1-n1.ib", "rack1-n3.ib", "rack2-n1.ib", "rack2-n3.ib"]
        );
    }

    #[test]
    fn malformed_lists_are_explained() {
        let too_many = format!("the host list expands to more than {MAX_HOSTS} hosts");
        let cases = [
            ("node[1-3", "unclosed '[' in \"node[1-3\""),
            ("node1-3]", "unmatched ']' at byte 7 of \"node1-3]\""),
            ("n[3-1]", "range \"3-1\" in \"n[3-1]\" runs backwards"),
            (
                "n[a-b]",
                "\"a-b\" in \"n[a-b]\" is not a number or a range of numbers",
            ),
            ("a,,b", "empty host name in \"a,,b\""),
            ("", "empty host name in \"\""),
            ("n[0-999999999]", &too_many),
        ];
        for (list, error) in cases {
            assert_eq!(expand_slurm_nodelist(list), Err(error.into()), "{list}");
        }
    }
}
